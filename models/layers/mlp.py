"""The SwiGLU feed-forward layer.

Shape legend: B batch, L sequence length, D width (d_model), F hidden width.
"""

from __future__ import annotations

import jax
from flax import nnx

from models.layers.lora import project


class SwiGLU(nnx.Module):
    """FFN(x) = W_down (silu(W_gate x) ⊙ W_up x) (Shazeer, "GLU Variants Improve Transformer", 2020).

    ``__call__(x: float32[B, L, D]) -> float32[B, L, D]``; hidden width F = ``d_ff``. Parameters:
    ``gate/kernel``, ``up/kernel [D, F]``, ``down/kernel [F, D]``; the products go through
    :func:`models.layers.ops.linear` (explicit weight gradients).
    """

    def __init__(self, d_model: int, d_ff: int, n_layers: int, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.gate = nnx.Linear(d_model, d_ff, use_bias=False, kernel_init=init, rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, use_bias=False, kernel_init=init, rngs=rngs)
        out_init = nnx.initializers.normal(0.02 / (2 * n_layers) ** 0.5)
        self.down = nnx.Linear(d_ff, d_model, use_bias=False, kernel_init=out_init, rngs=rngs)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        h_BLF = jax.nn.silu(project(self.gate, x_BLD)) * project(self.up, x_BLD)
        return project(self.down, h_BLF)
