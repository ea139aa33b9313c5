"""Models a user builds from minidp.nn, for the pieces' spec tests: the pieces must work on
these as on minidp's own GPT and MLP."""

import numpy as np

from minidp import Tensor, nn


class Block(nn.Module):
    """A residual MLP block, as a user writes one: x + fc2(relu(fc1(norm(x))))."""

    def __init__(self, width: int, rng: np.random.Generator, dtype=np.float64):
        self.norm = nn.LayerNorm(width, dtype=dtype)
        self.fc1 = nn.Linear(width, 2 * width, rng=rng, dtype=dtype)
        self.fc2 = nn.Linear(2 * width, width, rng=rng, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.fc1(self.norm(x)).relu())
