"""The pre-norm transformer block shared by every family: x + attn(norm(x)), then x + mlp(norm(x))."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from models.layers.moe import MoE


class Block(nnx.Module):
    """Pre-norm residual block (RMSNorm before attention and before the MLP).

    ``make_attn()`` and ``make_mlp()`` build modules mapping float32[B, L, D] to the same shape (an
    MoE layer fits in place of the MLP); they are called between the norms, so the parameters draw
    their random keys in the block's order (norm, attention, norm, MLP).
    ``__call__(x: float32[B, L, D], mask: bool|float[B, L] | None = None) -> float32[B, L, D]``:
    ``mask`` (1 for a real token, 0 for padding) reaches an MoE layer's router
    (:class:`models.layers.moe.MoE`), which routes and counts real tokens only; a dense MLP and the
    attention ignore it (the rows are right-padded and causal, or not padded at all).
    """

    def __init__(
        self, d_model: int, make_attn: Callable[[], nnx.Module], make_mlp: Callable[[], nnx.Module], rngs: nnx.Rngs
    ):
        self.attn_norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.attn = make_attn()
        self.mlp_norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.mlp = make_mlp()

    def __call__(self, x_BLD: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD))
        h_BLD = self.mlp_norm(x_BLD)
        if mask is not None and isinstance(self.mlp, MoE):
            return x_BLD + self.mlp(h_BLD, mask)
        return x_BLD + self.mlp(h_BLD)
