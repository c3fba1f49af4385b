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
        return self._mlp_residual(x_BLD, mask)

    def _mlp_residual(self, x_BLD: jax.Array, mask: jax.Array | None) -> jax.Array:
        h_BLD = self.mlp_norm(x_BLD)
        if mask is not None and isinstance(self.mlp, MoE):
            return x_BLD + self.mlp(h_BLD, mask)
        return x_BLD + self.mlp(h_BLD)

    def prefill(self, x_BLD: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """``__call__`` of a causal block, also returning its attention's keys and values
        ``([B, N, L, C], [B, N, L, C])`` (:meth:`models.layers.attention.SelfAttention.prefill`)."""
        a_BLD, k_BNLC, v_BNLC = self.attn.prefill(self.attn_norm(x_BLD))
        return self._mlp_residual(x_BLD + a_BLD, mask), (k_BNLC, v_BNLC)

    def decode(
        self, x_BD: jax.Array, kv: tuple[jax.Array, jax.Array], pos_B: jax.Array, live_B: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """One new token per row (``x: [B, D]`` at positions ``pos_B``) through a causal block with
        its KV cache ``kv`` (``[B, N, S, C]`` each), updated and returned. ``live_B`` (float ``[B]``,
        0 for a row that is done or padding) is the MoE router's mask: each row's token is a group of
        its own, so its k choices always find room (see :class:`models.layers.moe.MoE`)."""
        a_BD, k_BNSC, v_BNSC = self.attn.decode(self.attn_norm(x_BD), *kv, pos_B)
        x_B1D = (x_BD + a_BD)[:, None, :]
        return self._mlp_residual(x_B1D, live_B[:, None])[:, 0], (k_BNSC, v_BNSC)
