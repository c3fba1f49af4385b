"""The dense decoder-only transformer LM (``kind: dense_lm``): RoPE, RMSNorm, SwiGLU, causal attention.

Shape legend: B batch, L sequence length, D d_model, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.layers.attention import SelfAttention
from models.layers.block import Block
from models.layers.mlp import SwiGLU
from models.layers.ops import softmax_cross_entropy_head
from models.spec import BatchLayout, InputShape, ModelSpec, count_params, register


class DecoderLM(nnx.Module):
    """Pre-norm decoder LM. ``__call__(ids: int32[B, L]) -> logits: float32[B, L, V]``.

    ``cfg``: a ``configs.model.DenseLMConfig`` (d_model, n_layers, n_heads, d_ff, tie_embeddings,
    rope_theta). ``make_mlp(i)`` builds block i's feed-forward layer (default: a SwiGLU of width
    d_ff; the MoE LM puts :class:`models.layers.moe.MoE` in some blocks). ``features(ids)`` is
    everything before the output projection (final-normed ``float32[B, L, D]``) and
    ``head_kernel()`` that projection as ``float32[D, V]``: the training objective fuses the two
    with the loss (:func:`lm_objective`).
    """

    def __init__(
        self, cfg, vocab_size: int, max_len: int, rngs: nnx.Rngs, make_mlp: Callable[[int], nnx.Module] | None = None
    ):
        self.vocab_size, self.max_len = vocab_size, max_len
        d = cfg.d_model
        make_mlp = make_mlp or (lambda i: SwiGLU(d, cfg.d_ff, cfg.n_layers, rngs))
        self.embed = nnx.Embed(vocab_size, d, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.blocks = nnx.List(
            [
                Block(
                    d,
                    partial(SelfAttention, d, cfg.n_heads, cfg.n_layers, cfg.rope_theta, True, rngs),
                    partial(make_mlp, i),
                    rngs,
                )
                for i in range(cfg.n_layers)
            ]
        )
        self.final_norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = (
            None
            if cfg.tie_embeddings
            else nnx.Linear(d, vocab_size, use_bias=False, kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        )

    def features(self, ids_BL: jax.Array, mask_BL: jax.Array | None = None) -> jax.Array:
        """Final-normed hidden states ``float32[B, L, D]`` of ``ids: int32[B, L]``. ``mask_BL``
        (1 for a real input token, 0 for padding; :func:`input_mask`) reaches the MoE layers'
        routers (padding is routed nowhere and takes no expert capacity); None: all real."""
        x_BLD = self.embed(ids_BL)
        for block in self.blocks:
            x_BLD = block(x_BLD, mask_BL)
        return self.final_norm(x_BLD)

    def head_kernel(self) -> jax.Array:
        """The output projection ``float32[D, V]``: the head's kernel, or the embedding transposed if tied."""
        return self.embed.embedding[...].T if self.head is None else self.head.kernel[...]

    def __call__(self, ids_BL: jax.Array, mask_BL: jax.Array | None = None) -> jax.Array:
        return self.features(ids_BL, mask_BL) @ self.head_kernel()

    def prefill(self, ids_BL: jax.Array, mask_BL: jax.Array | None = None) -> tuple[jax.Array, list]:
        """:meth:`features` ``float32[B, L, D]`` (the logits are ``features @ head_kernel()``; a
        decoder needs only the last real position's) and the KV cache of every block: a list of
        ``(k, v)``, each ``[B, N, L, C]`` (keys after RoPE). The prompt pass of
        :mod:`models.text.generate`."""
        x_BLD, cache = self.embed(ids_BL), []
        for block in self.blocks:
            x_BLD, kv = block.prefill(x_BLD, mask_BL)
            cache.append(kv)
        return self.final_norm(x_BLD), cache

    def decode(self, ids_B: jax.Array, cache: list, pos_B: jax.Array, live_B: jax.Array) -> tuple[jax.Array, list]:
        """Logits ``float32[B, V]`` of one new token per row (``ids_B`` int32 at positions ``pos_B``)
        from the KV cache of :meth:`prefill` (padded to S positions), and the cache with the new
        keys and values written. ``live_B``: float ``[B]``, 0 for rows whose output is not used
        (the MoE routers skip them)."""
        x_BD, out = self.embed(ids_B), []
        for block, kv in zip(self.blocks, cache, strict=True):
            x_BD, kv = block.decode(x_BD, kv, pos_B, live_B)
            out.append(kv)
        return self.final_norm(x_BD) @ self.head_kernel(), out


def lm_inputs(batch) -> jax.Array:
    """The input tokens ``int32[B, L]`` of a text batch: a packed ``int32[B, L+1]`` array, or a
    fine-tuning batch ``{"ids": int32[B, L+1], "mask": float32[B, L+1]}``."""
    ids_BT = batch["ids"] if isinstance(batch, dict) else batch
    return ids_BT[:, :-1]


def input_mask(batch) -> jax.Array | None:
    """Which input tokens of a text batch are real: ``float32[B, L]`` (1 real, 0 padding), or None
    for a packed ``int32[B, L+1]`` batch (every token real).

    A fine-tuning batch ``{"ids", "mask"}`` is right-padded (``data.finetune.pack_rows``): input t
    is real iff a target at t+1 or later has ``mask`` 1, i.e. everything up to the row's last
    target (prompts, responses, the separators of packed examples) is real and what follows it is
    padding; a row without a target is all padding. The MoE router reads it
    (:class:`models.layers.moe.MoE`)."""
    if not isinstance(batch, dict):
        return None
    m_BL = (batch["mask"][:, 1:] > 0).astype(jnp.float32)
    return jnp.flip(jax.lax.cummax(jnp.flip(m_BL, axis=1), axis=1), axis=1)


def lm_loss(x_BLD: jax.Array, head_DV: jax.Array, batch) -> jax.Array:
    """Next-token cross entropy in nats per predicted token, from the final hidden states.

    A packed batch ``int32[B, L+1]``: the mean over all B·L targets, through the fused head and loss
    (:func:`models.layers.ops.softmax_cross_entropy_head`). A fine-tuning batch ``{"ids", "mask"}``:
    the mean over the targets whose ``mask`` is 1 (response tokens only; the prompt and the padding
    add nothing), ``Σ mask[t]·nll[t] / Σ mask[t]`` over t = 1..L, 0 for a batch without a masked token.
    """
    if not isinstance(batch, dict):
        return softmax_cross_entropy_head(x_BLD, head_DV, batch[:, 1:])
    logits_BLV = jnp.matmul(x_BLD, head_DV, preferred_element_type=jnp.float32)  # float32 whatever the compute dtype
    nll_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["ids"][:, 1:])
    w_BL = batch["mask"][:, 1:].astype(jnp.float32)
    return jnp.sum(nll_BL * w_BL) / jnp.maximum(jnp.sum(w_BL), 1.0)


def lm_targets(batch) -> jax.Array:
    """The number of targets :func:`lm_loss` averages over, float32 scalar: B·L for a packed batch
    ``int32[B, L+1]``, ``Σ mask[:, 1:]`` (response tokens and their closing EOT) for a fine-tuning
    batch ``{"ids", "mask"}``. The train step weights each microbatch by it (``ModelSpec.targets``)."""
    if not isinstance(batch, dict):
        B, T = batch.shape
        return jnp.asarray(B * (T - 1), jnp.float32)
    return jnp.sum(batch["mask"][:, 1:].astype(jnp.float32))


def lm_objective(model: nnx.Module, batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross entropy in nats (:func:`lm_loss`) over a packed batch ``int32[B, L+1]``
    (T = L + 1), or over the response tokens of a fine-tuning batch ``{"ids", "mask"}``.

    Returns ``(loss, {})``: the loss is the whole objective; no extra metrics. On a packed batch the
    same value as ``optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()``.
    """
    return lm_loss(model.features(lm_inputs(batch)), model.head_kernel(), batch), {}


def flops_per_token(cfg, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N_matmul + 12·n_layers·d_model·L_ctx (attention scores).

    Kaplan et al. 2020 / Chinchilla (Hoffmann et al. 2022, App. F) accounting: forward 2 FLOPs per
    multiply-add, backward twice the forward. The output projection (V·D) counts as a matmul whether
    or not it is tied; norms and the embedding lookup are ignored. The attention term uses the full
    context length L (PaLM, Chowdhery et al. 2022, App. B), as MFU figures in the field do.
    """
    d, f, n = cfg.d_model, cfg.d_ff, cfg.n_layers
    matmul_params = n * (4 * d * d + 3 * d * f) + d * vocab_size
    return 6.0 * matmul_params + 12.0 * n * d * seq_len


@register("dense_lm")
def build_dense_lm(cfg, shape: InputShape) -> ModelSpec:
    """Spec of a :class:`DecoderLM` for a tokenizer of ``shape.vocab_size`` and rows of
    ``shape.seq_len`` + 1 tokens. Raises ``ValueError`` if either is missing."""
    if not shape.vocab_size or not shape.seq_len:
        raise ValueError("a dense_lm needs the data's vocab_size and seq_len")
    V, L = shape.vocab_size, shape.seq_len

    def init(seed: int) -> DecoderLM:
        return DecoderLM(cfg, V, L, nnx.Rngs(seed))

    abstract = nnx.eval_shape(lambda: init(0))
    return ModelSpec(
        kind="dense_lm",
        config=cfg,
        init=init,
        objective=lm_objective,
        targets=lm_targets,
        batch=BatchLayout(dtype="int32", row_shape=(L + 1,), unit="tokens", units_per_row=L),
        params=count_params(abstract),
        flops_per_unit=flops_per_token(cfg, V, L),
    )
