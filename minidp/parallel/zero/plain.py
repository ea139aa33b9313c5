"""ZeRO stage 3, the plain idea (Rajbhandari et al., "ZeRO", SC 2020): no rank holds the
whole model. Each rank keeps 1/N of every layer's parameters (its chunk) and the optimizer
state of that chunk only; a layer is whole on a rank only while it runs.

    mpiexec -n 4 python examples/zero.py          (beside FSDP, the full version)

    zero3 = SimpleZeRO3(model)                    # every rank keeps its chunk of each layer
    opt = optim.AdamW(zero3.parameters(), lr)     # the chunks: Ψ/N numbers per rank
    loss = cross_entropy(zero3(x), y)             # each layer gathered, run, freed
    loss.backward()                               # ... gathered again, gradients
    opt.step()                                    #     reduce-scattered into the chunks

Per layer u (each direct child of the model: its parameters flattened into one vector of
n_u numbers, rank r's chunk = chunk_bounds(n_u, N)[r]):

    forward    allgather u's chunks -> whole weights; y = u(x), recording nothing; free
    backward   allgather again; y = u(x) once more, recording; backprop dL/dy through it;
               reduce-scatter u's gradients (the mean over ranks) -> my chunk's gradient;
               free

So one layer is whole at a time, and 3(N-1)/N·Ψ numbers cross per step (two allgathers and
a reduce-scatter of every layer): 1.5x data parallelism's allreduce. Running u's forward a
second time in its backward is the plain way to free u in between: the graph of the first
run would otherwise keep u's gathered weights alive (its ops hold the arrays they read)
until backward, and every layer would be whole again at the end of the forward. The rerun
must draw what the first run drew: a Dropout's generator is set back for it, then returned
to where the step had taken it. stage3.py and fsdp.py (FullyShardedDataParallel, the full
version) avoid the rerun with two gather slots reused in turn, and add what this file leaves
out: parameters outside the children or shared by two (a tied weight), uneven batches,
micro-batches accumulated without communication (no_sync), overlap.

Between its forward and its backward a layer's parameters are NaN stand-ins (their shape,
one element of memory): a read elsewhere (a tied weight, model.state_dict()) gives NaN, not
a silently wrong number; full_state_dict() gathers them. Each layer is one op of the engine
whose parents are its input and its chunk (a Parameter): backward hands the chunk its
gradient, and the optimizer steps the chunks.
"""

import numpy as np

from minidp import comm
from minidp.engine.deferred import flat_values, materialize
from minidp.engine.nn import Dropout, Module, Parameter
from minidp.engine.tensor import Tensor, no_grad, op
from minidp.parallel.same_model import broadcast_parameters, check_same_model
from minidp.tools.chunks import chunk_bounds


class SimpleZeRO3:
    """Shard `model` over `group` (default: the world), layer by layer (see above). Every
    trainable parameter must belong to exactly one direct child of the model, in one dtype
    per child; each child takes one input (a Tensor, or data such as token ids) and returns
    one Tensor. Frozen parameters stay whole on every rank."""

    def __init__(self, model: Module, group: comm.Group | None = None):
        self.model, self.group = model, group or comm.world()
        self.layers = [child for _, child in model.children()]
        owned = [[p for p in layer.parameters() if p.requires_grad] for layer in self.layers]
        held = [id(p) for params in owned for p in params]
        trainable = [id(p) for p in model.parameters() if p.requires_grad]
        if sorted(held) != sorted(trainable) or len(set(held)) != len(held):
            raise ValueError(
                "every trainable parameter must belong to exactly one direct child of the "
                "model (FullyShardedDataParallel handles the others)"
            )
        check_same_model(model, self.group, deferred_ok=True)  # what follows: alike
        broadcast_parameters(model.parameters(), self.group)  # every rank from rank 0's weights
        materialize(*(p for p in model.parameters() if not p.requires_grad))  # kept whole
        N, r, self.params, self.chunks = self.group.size, self.group.rank, [], []
        for layer, params in zip(self.layers, owned):
            if not params:  # nothing to shard (an activation, a frozen layer): left alone
                continue
            if len({p.dtype for p in params}) > 1:
                raise ValueError(f"a layer's parameters must share one dtype: {type(layer)}")
            bounds = chunk_bounds(sum(p.size for p in params), N)  # my chunk, never the
            mine = flat_values(params, bounds[r], bounds[r + 1], params[0].dtype)  # whole layer
            self.params.append(params)  # per sharded layer: its parameters, my chunk
            self.chunks.append(Parameter(mine))
            self._free(params)
            layer.forward = self._sharded(len(self.chunks) - 1, layer, layer.forward)

    def __call__(self, *args, **kwargs):  # the model, its layers sharded in place
        return self.model(*args, **kwargs)

    def parameters(self) -> list[Parameter]:
        """This rank's chunks, one per layer: what its optimizer steps."""
        return [chunk for chunk in self.chunks if chunk.size]

    def full_state_dict(self) -> dict[str, np.ndarray]:
        """Collective: every parameter whole, by name, on every rank (copies)."""
        for u in range(len(self.chunks)):
            self._gather(u)
        state = {name: array.copy() for name, array in self.model.state_dict().items()}
        for params in self.params:
            self._free(params)
        return state

    def _sharded(self, u: int, layer: Module, forward):
        """Layer u's forward as one op: gathered, run, freed (see the module's table)."""
        rngs = [m.rng for m in modules_in(layer) if isinstance(m, Dropout)]

        def run(x):
            drawn = [g.bit_generator.state for g in rngs]  # where the first run starts
            self._gather(u)
            with no_grad():
                y = forward(x).data  # no graph: nothing keeps the whole weights
            self._free(self.params[u])

            def backward(dy):
                self._gather(u)
                now = [g.bit_generator.state for g in rngs]
                for g, state in zip(rngs, drawn):  # the rerun draws the first run's masks
                    g.bit_generator.state = state
                leaf = Tensor(x.data, requires_grad=x.requires_grad) if tensor else x
                forward(leaf).backward(dy)  # the same ops again, recorded, then backprop
                for g, state in zip(rngs, now):
                    g.bit_generator.state = state
                dtype = self.chunks[u].dtype
                grads = [np.zeros(p.shape, dtype) if p.grad is None else p.grad for p in params]
                flat = np.concatenate([g.ravel() for g in grads])  # None: this input skipped p
                mine = comm.reduce_scatter(flat, op="avg", group=self.group)
                for p in params:
                    p.grad = None
                self._free(params)
                return (leaf.grad, mine) if tensor else (mine,)

            params, tensor = self.params[u], isinstance(x, Tensor)
            return op(y, (x, self.chunks[u]) if tensor else (self.chunks[u],), backward)

        return run

    def _gather(self, u: int) -> None:
        """Every rank's chunk of layer u in rank order: the whole vector, in the parameters."""
        params = self.params[u]
        whole = np.empty(sum(p.size for p in params), self.chunks[u].dtype)
        comm.allgather(self.chunks[u].data, group=self.group, out=whole)
        start = 0
        for p in params:
            p.data = whole[start : start + p.size].reshape(p.shape)
            start += p.size

    @staticmethod
    def _free(params) -> None:
        for p in params:  # its shape, one element of memory, NaN wherever it is read
            p.data, p.recipe = np.broadcast_to(np.array(np.nan, p.dtype), p.shape), None


def modules_in(module: Module) -> list[Module]:
    """`module` and every module inside it, depth first."""
    return [module] + [m for _, child in module.children() for m in modules_in(child)]
