"""Dense decoder-only transformer LM in Flax NNX: RoPE, RMSNorm, SwiGLU, causal attention.

Shape legend: B batch, L sequence length, D d_model, H heads, K head dim (D / H), F SwiGLU hidden,
V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from configs.schema import ModelConfig


def rope_tables(length: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Rotary position tables (Su et al., RoFormer, Eq. 34): cos/sin of shape [L, K/2], float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles_LK = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles_LK), jnp.sin(angles_LK)


def apply_rope(x_BLHK: jax.Array, cos_LK: jax.Array, sin_LK: jax.Array) -> jax.Array:
    """Rotate pairs (x[..., :K/2], x[..., K/2:]) by the position angle (the "rotate half" form)."""
    half = x_BLHK.shape[-1] // 2
    x1, x2 = x_BLHK[..., :half], x_BLHK[..., half:]
    cos = cos_LK[None, :, None, :]
    sin = sin_LK[None, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h = cfg.d_model, cfg.n_heads
        self.n_heads, self.head_dim, self.theta = h, d // h, cfg.rope_theta
        init = nnx.initializers.normal(0.02)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, kernel_init=init, rngs=rngs)
        out_init = nnx.initializers.normal(0.02 / (2 * cfg.n_layers) ** 0.5)
        self.out = nnx.Linear(d, d, use_bias=False, kernel_init=out_init, rngs=rngs)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        B, L, D = x_BLD.shape
        qkv = self.qkv(x_BLD).reshape(B, L, 3, self.n_heads, self.head_dim)
        q_BLHK, k_BLHK, v_BLHK = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        cos, sin = rope_tables(L, self.head_dim, self.theta)
        q_BLHK, k_BLHK = apply_rope(q_BLHK, cos, sin), apply_rope(k_BLHK, cos, sin)
        y_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BLHK, v_BLHK, is_causal=True)
        return self.out(y_BLHK.reshape(B, L, D))


class SwiGLU(nnx.Module):
    """FFN(x) = W_down (silu(W_gate x) ⊙ W_up x) (Shazeer, "GLU Variants Improve Transformer", 2020)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.gate = nnx.Linear(cfg.d_model, cfg.d_ff, use_bias=False, kernel_init=init, rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, use_bias=False, kernel_init=init, rngs=rngs)
        out_init = nnx.initializers.normal(0.02 / (2 * cfg.n_layers) ** 0.5)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, use_bias=False, kernel_init=out_init, rngs=rngs)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x_BLD)) * self.up(x_BLD))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.mlp = SwiGLU(cfg, rngs)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD))
        return x_BLD + self.mlp(self.mlp_norm(x_BLD))


class DecoderLM(nnx.Module):
    """Pre-norm decoder LM. ``__call__(ids_BL: int32[B, L]) -> logits_BLV: float32[B, L, V]``."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, max_len: int, rngs: nnx.Rngs):
        self.cfg, self.vocab_size, self.max_len = cfg, vocab_size, max_len
        self.embed = nnx.Embed(vocab_size, cfg.d_model, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.final_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.head = (
            None
            if cfg.tie_embeddings
            else nnx.Linear(cfg.d_model, vocab_size, use_bias=False, kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        )

    def __call__(self, ids_BL: jax.Array) -> jax.Array:
        x_BLD = self.embed(ids_BL)
        for block in self.blocks:
            x_BLD = block(x_BLD)
        x_BLD = self.final_norm(x_BLD)
        if self.head is None:
            return self.embed.attend(x_BLD)
        return self.head(x_BLD)


def loss_fn(model: nnx.Module, batch_BT: jax.Array) -> jax.Array:
    """Mean next-token cross entropy in nats over a packed batch ``int32[B, L+1]``."""
    logits_BLV = model(batch_BT[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch_BT[:, 1:]).mean()


def count_params(model: nnx.Module) -> int:
    """Number of trainable scalars (``nnx.Param`` leaves)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N_matmul + 12·n_layers·d_model·L_ctx (attention scores).

    Kaplan et al. 2020 / Chinchilla (Hoffmann et al. 2022, App. F) accounting: forward 2 FLOPs per
    multiply-add, backward twice the forward. The output projection (V·D) counts as a matmul whether
    or not it is tied; norms and the embedding lookup are ignored. The attention term uses the full
    context length L (PaLM, Chowdhery et al. 2022, App. B), as MFU figures in the field do.
    """
    d, f, n = cfg.d_model, cfg.d_ff, cfg.n_layers
    matmul_params = n * (4 * d * d + 3 * d * f) + d * vocab_size
    return 6.0 * matmul_params + 12.0 * n * d * seq_len
