"""Mesh: the rank grid, one group per axis, built once and passed explicitly.

Every scheme that splits the work more than one way (data x tensor, ZeRO over the data axis)
needs the same facts about each rank: where it sits on each axis and which ranks share its
work along each axis. They are computed here, once, from one grid. The grid has a third
axis, pp, the pipeline's stages in order (strategies/pp.py builds the whole dp x tp x pp
mesh; tp, and hybrid without --pp, build it with pp = 1):

    grid = arange(world).reshape(dp, pp, tp)          tp fastest: a TP group is made of
                                                      neighbouring ranks (on one node, where
                                                      its many small allreduces are cheapest)
    dp=2, pp=1, tp=2, world 4:

                 tp ->
        dp=0   [ 0  1 ]     tp groups: {0, 1} {2, 3}   (same d and p: the layer's shards)
        dp=1   [ 2  3 ]     dp groups: {0, 2} {1, 3}   (same p and t: replicas of one shard)
                            pp groups: {0} {1} {2} {3} (same d and t: the stages, in order)

A rank's coordinates (d, p, t) are its index in the grid; the group of an axis holds the
ranks that differ only on that axis, ordered by that coordinate, so `mesh.tp_group.rank == t`.
Each group is made with `Group.split` (collective over the parent: every rank builds all
three). There is no module-level mesh: a strategy builds one and hands it to what needs it.
"""

import numpy as np

from minidp import comm

AXES = ("dp", "pp", "tp")  # the grid's axes, slowest to fastest


class Mesh:
    """The rank grid of `group` (default: the world) as dp x pp x tp; see the module doc.

    Attributes: `dp, pp, tp` (sizes), `coords` {"dp": d, "pp": p, "tp": t} of this rank,
    `dp_group, pp_group, tp_group` (this rank's group on each axis), `grid` (world-group
    ranks), `pp_prev, pp_next` (group ranks of the previous and next stage, None at the ends).

    A size that is not a positive integer, or sizes whose product is not `group.size`, is a
    ValueError naming the arguments (the command line turns it into its flags' words).
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, group: comm.Group | None = None):
        self.group = group or comm.world()
        sizes = {"dp": dp, "pp": pp, "tp": tp}
        for axis, n in sizes.items():
            if not (isinstance(n, int | np.integer) and n >= 1):
                raise ValueError(f"{axis} must be a positive integer, got {n!r}")
        if dp * tp * pp != self.group.size:
            raise ValueError(
                f"dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp}, but group has "
                f"{self.group.size} ranks; choose sizes whose product is {self.group.size}"
            )
        self.dp, self.pp, self.tp = dp, pp, tp
        self.grid = np.arange(self.group.size).reshape(dp, pp, tp)
        d, p, t = (int(i) for i in np.argwhere(self.grid == self.group.rank)[0])
        self.coords = {"dp": d, "pp": p, "tp": t}
        # one split per axis: the color names the line of the grid, the key orders it
        self.tp_group = self.group.split(d * pp + p, key=t)
        self.dp_group = self.group.split(p * tp + t, key=d)
        self.pp_group = self.group.split(d * tp + t, key=p)
        self.pp_prev = p - 1 if p > 0 else None
        self.pp_next = p + 1 if p < pp - 1 else None

    def groups(self) -> dict[str, comm.Group]:
        """{"dp": dp_group, "tp": tp_group, "pp": pp_group}: this rank's group on each axis."""
        return {"dp": self.dp_group, "tp": self.tp_group, "pp": self.pp_group}

    def members(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, as lists of world-group ranks in group-rank order."""
        moved = np.moveaxis(self.grid, AXES.index(axis), -1)  # that axis last
        return [list(map(int, line)) for line in moved.reshape(-1, moved.shape[-1])]

    def describe(self) -> str:
        """One line for the header: the sizes and which ranks form each group."""

        def show(axis):
            return " ".join("{" + ",".join(map(str, g)) + "}" for g in self.members(axis))

        return (
            f"mesh dp {self.dp} x pp {self.pp} x tp {self.tp} | tp groups {show('tp')} | "
            f"dp groups {show('dp')} | pp groups {show('pp')}"
        )

    def close(self) -> None:
        """Free the three communicators (collective over the parent group)."""
        for g in (self.tp_group, self.dp_group, self.pp_group):
            if not g.broken:
                g.free()
