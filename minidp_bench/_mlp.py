"""The MLP the benchmarks train, and one SGD step of it three ways: minidp, NumPy by hand, torch.

`bench autograd` races the three on one process; `bench dp` wraps the minidp step in DDP and
races the hand-written one, with its own allreduces, against it.

    x ──► [Linear ─► ReLU] x (L-1) ──► Linear ──► softmax cross-entropy
    backward, layer i from the top:  dW_i = a_i^T dz,  db_i = sum(dz),  dz <- (dz W_i^T) * (h > 0)
"""

import numpy as np

from minidp.engine import nn, optim
from minidp.engine.tensor import Tensor

SIZES = (784, 1024, 1024, 10)  # the default network: 784*1024 + 1024*1024 + 1024*10 weights
BATCH = 256  # examples per step (bench dp: per rank)
LR = 0.01


def parse_sizes(text: str) -> tuple[int, ...]:
    """'784,1024,10' -> (784, 1024, 10); ValueError for fewer than two positive sizes."""
    sizes = tuple(int(s) for s in text.split(","))
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"need two or more positive layer sizes, got {text!r}")
    return sizes


def make_model(sizes, seed: int = 0, fuse_relu: bool = True) -> nn.MLP:
    return nn.MLP(list(sizes), rng=np.random.default_rng(seed), fuse_relu=fuse_relu)


def make_data(sizes, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, labels): float32 inputs and integer targets for an MLP of `sizes`."""
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((batch, sizes[0])).astype(np.float32),
        rng.integers(0, sizes[-1], batch),
    )


def ddp_per_algo(sizes, group, algos, bucket_mb: float) -> dict:
    """{(algo, overlap): DDP around a fresh MLP}, overlap on and off for every algo."""
    from minidp.parallel import DistributedDataParallel

    return {
        (algo, overlap): DistributedDataParallel(
            make_model(sizes), group, bucket_cap_mb=bucket_mb, algo=algo, overlap=overlap
        )
        for algo in algos
        for overlap in (True, False)
    }


def ddp_sgd_step(ddp, x, y, lr: float = LR):
    """One step of DDP around the MLP: zero_grad, forward, backward, the sync, SGD."""
    opt = optim.SGD(ddp.parameters(), lr=lr)

    def step():
        ddp.zero_grad()
        nn.cross_entropy(ddp(Tensor(x)), y).backward()
        ddp.finish_gradient_sync()
        opt.step()

    return step


def minidp_step(model, opt, x, y):
    """One step through the engine: forward, cross-entropy, loss.backward(), opt.step()."""

    def step():
        loss = nn.cross_entropy(model(Tensor(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def minidp_sgd_step(model, x, y, lr: float = LR):
    return minidp_step(model, optim.SGD(model.parameters(), lr=lr), x, y)


def weights_of(model: nn.MLP) -> list[tuple[np.ndarray, np.ndarray]]:
    """Copies of the model's (W, b) per layer: the hand-written networks start from them."""
    return [(layer.weight.data.copy(), layer.bias.data.copy()) for layer in model.layers]


def numpy_gradients(weights, x, y, scale: float = 1.0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(dW, db) per layer of `scale` * mean cross-entropy, forward and backward by hand."""
    last = len(weights) - 1
    inputs, pre = [x], []  # each layer's input a_i, and the hidden pre-activations h_i
    for i, (W, b) in enumerate(weights):
        h = inputs[-1] @ W
        h += b
        if i < last:
            pre.append(h)
            inputs.append(np.maximum(h, 0))
    z = h  # the logits
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    dz = p  # d loss / d z = scale * (softmax - onehot) / N
    dz[np.arange(len(y)), y] -= 1
    dz *= z.dtype.type(scale / len(y))
    grads = []
    for i in range(last, -1, -1):
        grads.append((inputs[i].T @ dz, dz.sum(axis=0)))
        if i:
            dz = dz @ weights[i][0].T
            dz *= pre[i - 1] > 0
    return grads[::-1]


def numpy_step(weights, x, y, lr: float = LR):
    """The MLP's SGD step written out by hand: the floor for minidp on one process."""

    def step():
        for (W, b), (dW, db) in zip(weights, numpy_gradients(weights, x, y), strict=True):
            W -= lr * dW
            b -= lr * db

    return step


def torch_mlp_step(torch, model, x, y, lr: float = LR, wrap=None):
    """A torch twin of a minidp MLP (same weights; W is (in, out) here, (out, in) in torch)
    and one SGD training step on (x, y). `wrap` wraps the torch model (e.g. in DDP)."""
    layers = []
    for i, layer in enumerate(model.layers):
        linear = torch.nn.Linear(*layer.weight.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(layer.weight.data.T.copy()))
            linear.bias.copy_(torch.from_numpy(layer.bias.data))
        layers += [linear] + ([torch.nn.ReLU()] if i < len(model.layers) - 1 else [])
    net = torch.nn.Sequential(*layers)
    net = wrap(net) if wrap else net
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def step():
        loss = torch.nn.functional.cross_entropy(net(tx), ty)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step
