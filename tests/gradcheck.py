"""Shared test helpers: central-difference gradient checks and the Hypothesis profile.

`check_gradients(fn, arrays)` compares minidp's backward of L = sum(fn(*inputs) * w), for a
fixed random weight w, with central differences of the same L in float64:

    dL/dx_i  ~  (L(x + eps e_i) - L(x - eps e_i)) / (2 eps)       error O(eps^2) + O(ulp/eps)

A random w (rather than ones) makes every output element matter with a different weight, so a
gradient routed to the wrong place cannot hide behind a symmetric sum.
"""

import numpy as np
from hypothesis import HealthCheck, settings

from minidp import Tensor, no_grad

# Modest and derandomized: the same examples on every run, a few seconds for the whole table.
SETTINGS = settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

EPS = 1e-6
RTOL = 1e-6
ATOL = 1e-8


def numerical_gradients(loss, arrays: list[np.ndarray], eps: float = EPS) -> list[np.ndarray]:
    """Central differences of the scalar `loss()` with respect to each array, perturbed in place."""
    grads = []
    for x in arrays:
        g = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            old = x[i]
            x[i] = old + eps
            up = loss()
            x[i] = old - eps
            down = loss()
            x[i] = old
            g[i] = (up - down) / (2 * eps)
        grads.append(g)
    return grads


def output_weight(shape: tuple, seed: int = 1234) -> np.ndarray:
    """The fixed random w of L = sum(out * w)."""
    return np.random.default_rng(seed).standard_normal(shape)


def check_gradients(fn, arrays, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Backward of sum(fn(*Tensors) * w) must match central differences, input by input."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    inputs = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    out = fn(*inputs)
    w = output_weight(out.shape)
    (out * Tensor(w)).sum().backward()

    def loss() -> float:
        with no_grad():
            return float(np.sum(fn(*[Tensor(a) for a in arrays]).data * w))

    expected = numerical_gradients(loss, arrays)
    for k, (t, g) in enumerate(zip(inputs, expected)):
        assert t.grad is not None, f"input {k} got no gradient"
        assert t.grad.shape == t.shape, f"input {k}: grad {t.grad.shape} != input {t.shape}"
        np.testing.assert_allclose(t.grad, g, rtol=rtol, atol=atol, err_msg=f"input {k}")
