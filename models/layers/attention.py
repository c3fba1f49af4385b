"""Multi-head self-attention with rotary position embeddings.

Shape legend: B batch, L sequence length, D width (d_model), N heads, C channels per head (D / N).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rope_tables(length: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Rotary position tables (Su et al., RoFormer, Eq. 34): cos and sin, float32 ``[L, C/2]``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_LC = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles_LC), jnp.sin(angles_LC)


def apply_rope(x_BLNC: jax.Array, cos_LC: jax.Array, sin_LC: jax.Array) -> jax.Array:
    """Rotate pairs (x[..., :C/2], x[..., C/2:]) by the position angle (the "rotate half" form)."""
    half = x_BLNC.shape[-1] // 2
    x1, x2 = x_BLNC[..., :half], x_BLNC[..., half:]
    cos = cos_LC[None, :, None, :]
    sin = sin_LC[None, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class SelfAttention(nnx.Module):
    """Fused QKV projection, RoPE on queries and keys, scaled dot-product attention, output projection.

    ``causal``: each position attends to itself and earlier ones (decoder LM); else to all.
    ``__call__(x: float32[B, L, D]) -> float32[B, L, D]``. Output projection initialised with
    std 0.02 / sqrt(2 · n_layers) (GPT-2's residual scaling).
    """

    def __init__(self, d_model: int, n_heads: int, n_layers: int, rope_theta: float, causal: bool,
                 rngs: nnx.Rngs):
        self.n_heads, self.head_dim, self.theta, self.causal = n_heads, d_model // n_heads, rope_theta, causal
        init = nnx.initializers.normal(0.02)
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, kernel_init=init, rngs=rngs)
        out_init = nnx.initializers.normal(0.02 / (2 * n_layers) ** 0.5)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, kernel_init=out_init, rngs=rngs)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        B, L, D = x_BLD.shape
        qkv = self.qkv(x_BLD).reshape(B, L, 3, self.n_heads, self.head_dim)
        q_BLNC, k_BLNC, v_BLNC = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        cos, sin = rope_tables(L, self.head_dim, self.theta)
        q_BLNC, k_BLNC = apply_rope(q_BLNC, cos, sin), apply_rope(k_BLNC, cos, sin)
        y_BLNC = jax.nn.dot_product_attention(q_BLNC, k_BLNC, v_BLNC, is_causal=self.causal)
        return self.out(y_BLNC.reshape(B, L, D))
