# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 01 · Autograd, step by step
#
# Launch line:
#
# python tutorials/01_autograd.py
#
# Training needs the gradient of a loss with respect to every parameter. minidp's engine
# (`minidp/engine/tensor.py`) records each operation as it runs, then walks the record backwards,
# applying the chain rule once per operation. This tutorial builds that idea up and checks
# every gradient against **central differences**: (f(x + h) - f(x - h)) / 2h.

# %%
import numpy as np

import minidp
from minidp import Tensor
from minidp.tools.info import one_blas_thread

one_blas_thread()  # one BLAS thread, as each rank of the later tutorials has

# %% [markdown]
# ## 1. A tensor remembers where it came from
# `requires_grad=True` marks a leaf we want gradients for. Each op's result keeps its inputs
# (`_parents`) and a `backward` closure written right beside the forward
# (minidp/engine/tensor_ops.py; the engine itself: minidp/engine/tensor.py).

# %%
x = Tensor([2.0, -1.0, 3.0], requires_grad=True)
y = (x * x).sum()  # y = sum x_i^2, so dy/dx = 2x
y.backward()
print("x.grad =", x.grad)
assert np.allclose(x.grad, 2 * x.data)

# %% [markdown]
# ## 2. The chain rule, checked numerically
# A small function with several ops. We compare `backward()` with central differences in
# float64 (float32 would drown the difference quotient in rounding error).


# %%
def f(t: Tensor) -> Tensor:
    return ((t.tanh() * 3.0 + t.exp()) / (1.0 + t * t)).log().sum()


def numerical_grad(fn, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + h
        up = fn(Tensor(x)).item()
        x[i] = old - h
        down = fn(Tensor(x)).item()
        x[i] = old
        grad[i] = (up - down) / (2 * h)
    return grad


x0 = np.array([0.3, 1.2, 2.0])  # float64: NumPy arrays keep their dtype
t = Tensor(x0.copy(), requires_grad=True)
f(t).backward()
numeric = numerical_grad(f, x0.copy())
print("autograd:", t.grad)
print("numeric: ", numeric)
assert np.allclose(t.grad, numeric, rtol=1e-7, atol=1e-9)

# %% [markdown]
# ## 3. Broadcasting has a gradient too
# Adding a bias of shape (3,) to a batch of shape (4, 3) copies it down 4 rows; the reverse
# of copying is **summing**, so the bias gradient sums over the batch (`unbroadcast`).

# %%
X = Tensor(np.ones((4, 3)))
b = Tensor(np.zeros(3), requires_grad=True)
(X + b).sum().backward()
print("bias grad:", b.grad)
assert np.array_equal(b.grad, [4.0, 4.0, 4.0])

# %% [markdown]
# ## 4. Matrix products: dA = g Bᵀ, dB = Aᵀ g
# and a tensor used twice receives the **sum** of both paths' gradients.

# %%
rng = np.random.default_rng(0)
A = Tensor(rng.standard_normal((2, 3)), requires_grad=True)
B = Tensor(rng.standard_normal((3, 2)), requires_grad=True)
loss = (A @ B @ B.T).sum()  # B is used twice
loss.backward()
g = np.ones((2, 3))
assert np.allclose(A.grad, g @ (B.data @ B.data.T).T)
numeric_B = numerical_grad(lambda t: (Tensor(A.data) @ t @ t.T).sum(), B.data.copy())
assert np.allclose(B.grad, numeric_B, rtol=1e-6)
print("matmul gradients match")

# %% [markdown]
# ## 5. Indexing with repeated indices accumulates
# An embedding lookup reads row 1 twice; its gradient must count both reads.

# %%
table = Tensor(np.arange(6.0).reshape(3, 2), requires_grad=True)
table[np.array([1, 1, 2])].sum().backward()
print(table.grad)
assert np.array_equal(table.grad, [[0, 0], [2, 2], [1, 1]])

# %% [markdown]
# ## 6. A stable cross-entropy
# `cross_entropy` subtracts the row maximum before `exp`, so huge logits do not overflow,
# and its backward is simply (softmax − one-hot) / N.

# %%
logits = Tensor(np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]]), requires_grad=True)
loss = minidp.cross_entropy(logits, np.array([0, 2]))
loss.backward()
print("loss", loss.item())
assert np.isfinite(loss.item()) and np.isclose(loss.item(), np.log(3) / 2)
assert np.allclose(logits.grad[1], (np.full(3, 1 / 3) - [0, 0, 1]) / 2)

# %% [markdown]
# ## 7. Hooks: knowing when a gradient is final
# Backward visits operations in reverse topological order, so a parameter's gradient is
# final once every op that used it has run. A grad-ready hook fires exactly then. Data
# parallelism (tutorial 05) starts sending gradients from these hooks while backward goes
# on. Here the last layer's parameters (its bias, then its weight) are ready first.

# %%
mlp = minidp.nn.MLP([4, 8, 8, 2], rng=np.random.default_rng(0))
ready = []
for name, p in mlp.named_parameters():
    p.register_grad_ready_hook(lambda p, name=name: ready.append(name))
minidp.cross_entropy(mlp(Tensor(rng.standard_normal((5, 4)))), np.array([0, 1, 0, 1, 1])).backward()
print("ready order:", ready)
assert ready[:2] == ["layers.2.bias", "layers.2.weight"] and ready[-1].startswith("layers.0")
assert sorted(ready) == sorted(name for name, _ in mlp.named_parameters())

# %% [markdown]
# ## 8. `no_grad`: evaluation records nothing

# %%
with minidp.no_grad():
    out = mlp(Tensor(np.ones((1, 4))))
assert not out.requires_grad

# %% [markdown]
# ## 9. Writing a new op
# An op computes its forward on arrays and hands `minidp.op(data, parents, backward)` a
# closure mapping the output gradient `g` to one gradient per parent (never writing into
# `g`; `minidp.engine.tensor.unbroadcast` undoes broadcasting). Here softplus(x) = log(1 + eˣ),
# whose derivative is the sigmoid, checked by central differences like every op above.


# %%
def softplus(x: Tensor) -> Tensor:
    s = 1 / (1 + np.exp(-x.data))  # d/dx log(1 + e^x) = sigmoid(x)
    return minidp.op(np.logaddexp(0, x.data), (x,), lambda g: (g * s,))


t = Tensor(x0.copy(), requires_grad=True)
(softplus(t) * t).sum().backward()
numeric = numerical_grad(lambda t: (softplus(t) * t).sum(), x0.copy())
assert np.allclose(t.grad, numeric, rtol=1e-7, atol=1e-9)
print("softplus gradient matches")

# %% [markdown]
# Parallel schemes write their communication ops the same way. Megatron's f is the identity
# forward and an allreduce of `g` backward; with a plain function in place of the allreduce:


# %%
def on_gradient(x: Tensor, fn) -> Tensor:
    """Identity forward; backward hands `fn(g)` on (Megatron's f: fn = allreduce)."""
    return minidp.op(x.data, (x,), lambda g: (fn(g),))


t = Tensor(x0.copy(), requires_grad=True)
on_gradient(t, lambda g: 0.5 * g).sum().backward()  # a "scale gradient" op
assert np.array_equal(t.grad, np.full(3, 0.5))
print("done: every gradient above matched its check")
