"""Mesh: the rank grid, one group per axis, built once and passed explicitly.

Every scheme that splits the work more than one way (data x tensor, ZeRO over the data axis)
needs the same facts about each rank: where it sits on each axis and which ranks share its
work along each axis. They are computed here, once, from one grid. Besides dp and tp the
grid has pp, the pipeline's stages in order (strategies/pp.py builds the whole dp x tp x pp
mesh; tp, and hybrid without --pp, build it with pp = 1), and cp, the context-parallel
ranks that each hold T/C positions of every sequence (parallel/context_parallel/):

    grid = arange(world).reshape(dp, pp, cp, tp)      tp fastest, then cp (Megatron-LM's
                                                      order): a TP group is made of
                                                      neighbouring ranks (on one node, where
                                                      its many small allreduces are cheapest),
                                                      a CP group of the next nearest (its
                                                      ring passes K/V every block)
    dp=2, pp=1, cp=1, tp=2, world 4:

                 tp ->
        dp=0   [ 0  1 ]     tp groups: {0, 1} {2, 3}   (same d, p and c: the layer's shards)
        dp=1   [ 2  3 ]     dp groups: {0, 2} {1, 3}   (same p, c and t: replicas of one shard)
                            pp groups: {0} {1} {2} {3} (same d, c and t: the stages, in order)

    dp=2, cp=2, tp=2, world 8: rank = 4d + 2c + t; cp groups {0,2} {1,3} {4,6} {5,7}

A rank's coordinates (d, p, c, t) are its index in the grid; the group of an axis holds the
ranks that differ only on that axis, ordered by that coordinate, so `mesh.tp_group.rank == t`.
With cp = 1 the grid, every rank's coordinates and the dp, tp and pp groups are those of
the three-axis mesh (the cp groups are groups of one). Each group is made with
`Group.split` (collective over the parent: every rank builds all four). There is no
module-level mesh: a strategy builds one and hands it to what needs it.
"""

import numpy as np

from minidp import comm

AXES = ("dp", "pp", "cp", "tp")  # the grid's axes, slowest to fastest


class Mesh:
    """The rank grid of `group` (default: the world) as dp x pp x cp x tp; see the module doc.

    Attributes: `dp, pp, cp, tp` (sizes), `coords` {"dp": d, "pp": p, "cp": c, "tp": t} of
    this rank, `dp_group, pp_group, cp_group, tp_group` (this rank's group on each axis),
    `grid` (world-group ranks), `pp_prev, pp_next` (group ranks of the previous and next
    stage, None at the ends).

    A size that is not a positive integer, or sizes whose product is not `group.size`, is a
    ValueError naming the arguments (the command line turns it into its flags' words).
    """

    def __init__(
        self, dp: int = 1, tp: int = 1, pp: int = 1, group: comm.Group | None = None, cp: int = 1
    ):
        self.group = group or comm.world()
        sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        for axis, n in sizes.items():
            if not (isinstance(n, int | np.integer) and n >= 1):
                raise ValueError(f"{axis} must be a positive integer, got {n!r}")
        if dp * tp * pp * cp != self.group.size:
            axes = {"dp": dp, "tp": tp, "pp": pp, **({"cp": cp} if cp > 1 else {})}
            raise ValueError(
                f"{' x '.join(axes)} = {' x '.join(map(str, axes.values()))} = "
                f"{dp * tp * pp * cp}, but group has {self.group.size} ranks; choose sizes "
                f"whose product is {self.group.size}"
            )
        self.dp, self.pp, self.cp, self.tp = dp, pp, cp, tp
        self.grid = np.arange(self.group.size).reshape(dp, pp, cp, tp)
        d, p, c, t = (int(i) for i in np.argwhere(self.grid == self.group.rank)[0])
        self.coords = {"dp": d, "pp": p, "cp": c, "tp": t}
        # one split per axis: the color names the line of the grid (the other three
        # coordinates), the key orders it
        self.tp_group = self.group.split((d * pp + p) * cp + c, key=t)
        self.dp_group = self.group.split((p * cp + c) * tp + t, key=d)
        self.pp_group = self.group.split((d * cp + c) * tp + t, key=p)
        self.cp_group = self.group.split((d * pp + p) * tp + t, key=c)
        self.pp_prev = p - 1 if p > 0 else None
        self.pp_next = p + 1 if p < pp - 1 else None

    def groups(self) -> dict[str, comm.Group]:
        """{"dp", "tp", "pp", "cp": this rank's group on each axis}."""
        return {"dp": self.dp_group, "tp": self.tp_group, "pp": self.pp_group, "cp": self.cp_group}

    def members(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, as lists of world-group ranks in group-rank order."""
        moved = np.moveaxis(self.grid, AXES.index(axis), -1)  # that axis last
        return [list(map(int, line)) for line in moved.reshape(-1, moved.shape[-1])]

    def describe(self) -> str:
        """One line for the header: the sizes and which ranks form each group (cp's only
        where it has more than one rank)."""

        def show(axis):
            return " ".join("{" + ",".join(map(str, g)) + "}" for g in self.members(axis))

        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        cp_groups = f" | cp groups {show('cp')}" if self.cp > 1 else ""
        return (
            f"mesh dp {self.dp} x pp {self.pp}{cp} x tp {self.tp} | tp groups {show('tp')} | "
            f"dp groups {show('dp')} | pp groups {show('pp')}{cp_groups}"
        )

    def close(self) -> None:
        """Free the four communicators (collective over the parent group)."""
        for g in (self.tp_group, self.dp_group, self.pp_group, self.cp_group):
            if not g.broken:
                g.free()
