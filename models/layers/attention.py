"""Multi-head self-attention with rotary position embeddings.

Shape legend: B batch, L sequence length, D width (d_model), N heads, C channels per head (D / N).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers.lora import project
from models.layers.ops import cached_attention, causal_attention, rope, rope_at, rope_tables

__all__ = ["SelfAttention", "apply_rope", "rope_tables"]


def apply_rope(x_BLNC: jax.Array, cos_LC: jax.Array, sin_LC: jax.Array) -> jax.Array:
    """Rotate pairs (x[..., :C/2], x[..., C/2:]) by the position angle (the "rotate half" form)."""
    half = x_BLNC.shape[-1] // 2
    x1, x2 = x_BLNC[..., :half], x_BLNC[..., half:]
    cos = cos_LC[None, :, None, :].astype(x_BLNC.dtype)  # (bfloat16 compute stays bfloat16)
    sin = sin_LC[None, :, None, :].astype(x_BLNC.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class SelfAttention(nnx.Module):
    """Fused QKV projection, RoPE on queries and keys, scaled dot-product attention, output projection.

    ``causal``: each position attends to itself and earlier ones (decoder LM); else to all.
    ``__call__(x: float32[B, L, D]) -> float32[B, L, D]``. Output projection initialised with
    std 0.02 / sqrt(2 · n_layers) (GPT-2's residual scaling). Parameters: ``qkv/kernel [D, 3D]``
    (queries, keys, values, each head-major) and ``out/kernel [D, D]``.

    The causal path runs on :mod:`models.layers.ops` (explicit weight gradients, attention with its
    own backward) in head-major layout ``[B, N, L, C]``; the non-causal one on
    ``jax.nn.dot_product_attention``.
    """

    def __init__(self, d_model: int, n_heads: int, n_layers: int, rope_theta: float, causal: bool, rngs: nnx.Rngs):
        self.n_heads, self.head_dim, self.theta, self.causal = n_heads, d_model // n_heads, rope_theta, causal
        init = nnx.initializers.normal(0.02)
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, kernel_init=init, rngs=rngs)
        out_init = nnx.initializers.normal(0.02 / (2 * n_layers) ** 0.5)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, kernel_init=out_init, rngs=rngs)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        if self.causal:
            return self.prefill(x_BLD)[0]
        B, L, D = x_BLD.shape
        N, C = self.n_heads, self.head_dim
        cos_LC, sin_LC = rope_tables(L, C, self.theta)
        qkv = project(self.qkv, x_BLD).reshape(B, L, 3, N, C)
        q_BLNC, k_BLNC, v_BLNC = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q_BLNC, k_BLNC = apply_rope(q_BLNC, cos_LC, sin_LC), apply_rope(k_BLNC, cos_LC, sin_LC)
        y_BLNC = jax.nn.dot_product_attention(q_BLNC, k_BLNC, v_BLNC)
        return project(self.out, y_BLNC.reshape(B, L, D))

    def prefill(self, x_BLD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The causal forward pass (what ``__call__`` computes), also returning what a KV cache keeps:
        ``(y float32[B, L, D], k [B, N, L, C] after RoPE, v [B, N, L, C])`` in the compute dtype."""
        B, L, D = x_BLD.shape
        N, C = self.n_heads, self.head_dim
        cos_LC, sin_LC = rope_tables(L, C, self.theta)
        qkv_3BNLC = project(self.qkv, x_BLD).reshape(B, L, 3, N, C).transpose(2, 0, 3, 1, 4)
        q_BNLC, k_BNLC = rope(qkv_3BNLC[0], cos_LC, sin_LC), rope(qkv_3BNLC[1], cos_LC, sin_LC)
        y_BLNC = causal_attention(q_BNLC, k_BNLC, qkv_3BNLC[2]).transpose(0, 2, 1, 3)
        return project(self.out, y_BLNC.reshape(B, L, D)), k_BNLC, qkv_3BNLC[2]

    def decode(
        self, x_BD: jax.Array, k_BNSC: jax.Array, v_BNSC: jax.Array, pos_B: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One new token per row against a KV cache of S positions (causal only).

        ``x_BD``: the new tokens' inputs; ``k_BNSC``/``v_BNSC``: the cache (keys after RoPE) whose
        positions ``< pos_B`` hold the row's earlier tokens; ``pos_B`` (int32 ``[B]``, each < S): the
        new token's position. Its key and value are written at ``pos_B`` and it attends to positions
        ``0..pos_B``, with the scores and softmax of :func:`models.layers.ops.causal_attention`.
        Returns ``(y [B, D], k_BNSC, v_BNSC)`` with the cache updated.
        """
        B, D = x_BD.shape
        N, C = self.n_heads, self.head_dim
        qkv_3BNC = project(self.qkv, x_BD).reshape(B, 3, N, C).transpose(1, 0, 2, 3)
        cos_BC, sin_BC = rope_at(pos_B, C, self.theta)
        q_BNC = rope(qkv_3BNC[0], cos_BC[:, None, :], sin_BC[:, None, :])
        k_BNC = rope(qkv_3BNC[1], cos_BC[:, None, :], sin_BC[:, None, :])
        rows_B = jnp.arange(B)  # a scatter of one position per row: in place in the decode loop (a select
        # over the whole cache measured 50x slower on XLA:CPU)
        k_BNSC = k_BNSC.at[rows_B, :, pos_B, :].set(k_BNC.astype(k_BNSC.dtype), mode="promise_in_bounds")
        v_BNSC = v_BNSC.at[rows_B, :, pos_B, :].set(qkv_3BNC[2].astype(v_BNSC.dtype), mode="promise_in_bounds")
        y_BNC = cached_attention(q_BNC, k_BNSC, v_BNSC, pos_B)
        return project(self.out, y_BNC.reshape(B, D)), k_BNSC, v_BNSC
