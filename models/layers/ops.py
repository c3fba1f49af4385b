"""The model's hot spots written for XLA:CPU: three with hand-written backward passes (custom VJPs).

Each computes what its autodiff counterpart computes, in float32 (the golden losses reproduce to
1e-6 nats); what changes is the graph XLA gets. Measured on the default model, 2-core CPU, each
rule swapped back for autodiff in turn, learner step (8 × 128) / DP step (32 × 128), microbatches
of 4: see benchmarks/results/throughput_cpu-2core_2026-11-30.md.

* :func:`linear` (the learner step is 18 % slower without it): the transpose rule of
  ``dot_general`` hands XLA a weight-gradient dot that its CPU layout assignment feeds through a
  transposing copy of the activation gradient (fused with the SwiGLU backward, so the copy also
  recomputes it, at strided writes). ``einsum("ti,to->io")`` on the flattened rows compiles to one
  dot, no copy.
* :func:`causal_attention`: head-major ``[B, N, L, C]`` attention with the causal mask built from
  iotas inside the fusion. ``jax.nn.dot_product_attention``'s XLA path (a ``vmap`` over groups, a
  broadcast mask constant) made the learner step 28 % slower; the explicit backward saves a
  further 4 % on the DP step (nothing measurable on the learner's).
* :func:`softmax_cross_entropy_head` (9 % / 15 % slower without it): the output projection and the
  mean cross entropy in one rule whose forward pass also computes both gradients, a few rows at a
  time (``HEAD_ROWS``): the ``[rows, V]`` logits are never stored whole, the softmax is
  exponentiated once, the one-hot is a ``where`` (autodiff scattered it).

A custom VJP for RMSNorm (closed-form backward) and one for RoPE (rotation by −θ) measured no
faster than autodiff and are not used.

Shape legend: T rows (tokens, any leading shape flattened), I/O input/output width, R rows of one
head block, B batch, N heads, L query positions, M key positions, C channels per head, D width,
V vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


@jax.custom_vjp
def linear(x_TI: jax.Array, w_IO: jax.Array) -> jax.Array:
    """``x @ w`` (no bias) for ``x: float32[..., I]``, ``w: float32[I, O]`` → ``float32[..., O]``."""
    return x_TI @ w_IO


def _linear_fwd(x_TI, w_IO):
    return x_TI @ w_IO, (x_TI, w_IO)


def _linear_bwd(res, g_TO):
    x_TI, w_IO = res
    dx_TI = jnp.einsum("...o,io->...i", g_TO, w_IO)
    dw_IO = jnp.einsum("ti,to->io", x_TI.reshape(-1, x_TI.shape[-1]), g_TO.reshape(-1, g_TO.shape[-1]))
    return dx_TI.astype(x_TI.dtype), dw_IO.astype(w_IO.dtype)  # (a no-op when both are float32)


linear.defvjp(_linear_fwd, _linear_bwd)


def _inv_freq(head_dim: int, theta: float) -> jax.Array:
    """RoPE's frequencies θ^(−2i/C), i < C/2, float32 ``[C/2]`` (RoFormer, Eq. 15)."""
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def rope_tables(length: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Rotary position tables (Su et al., RoFormer, Eq. 34): cos and sin, float32 ``[L, C/2]``."""
    angles_LC = jnp.arange(length, dtype=jnp.float32)[:, None] * _inv_freq(head_dim, theta)[None, :]
    return jnp.cos(angles_LC), jnp.sin(angles_LC)


def rope_at(pos_B: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """:func:`rope_tables`' rows at positions ``pos_B`` (int ``[B]``): cos and sin, float32
    ``[B, C/2]``, the same numbers as ``rope_tables(L, ...)[pos_B]`` (one decoded token per row)."""
    angles_BC = pos_B.astype(jnp.float32)[:, None] * _inv_freq(head_dim, theta)[None, :]
    return jnp.cos(angles_BC), jnp.sin(angles_BC)


def rope(x_LC: jax.Array, cos_LC: jax.Array, sin_LC: jax.Array) -> jax.Array:
    """Rotate pairs ``(x[..., :C/2], x[..., C/2:])`` by the position angle (the "rotate half" form).

    ``x: float32[..., L, C]`` (positions on the second-to-last axis); ``cos``/``sin``: ``[L, C/2]``
    from :func:`rope_tables`. Plain autodiff (a custom rule measured no faster).
    """
    half = x_LC.shape[-1] // 2
    x1, x2 = x_LC[..., :half], x_LC[..., half:]
    cos_LC, sin_LC = cos_LC.astype(x_LC.dtype), sin_LC.astype(x_LC.dtype)  # (bfloat16 compute stays bfloat16)
    return jnp.concatenate([x1 * cos_LC - x2 * sin_LC, x2 * cos_LC + x1 * sin_LC], axis=-1)


def _causal_scores(q_BNLC, k_BNMC):
    # scores and their softmax in float32 whatever the inputs' dtype (bfloat16 compute)
    s_BNLM = jnp.einsum("bnlc,bnmc->bnlm", q_BNLC, k_BNMC, preferred_element_type=jnp.float32) * (
        1.0 / math.sqrt(q_BNLC.shape[-1])
    )
    row = jax.lax.broadcasted_iota(jnp.int32, s_BNLM.shape, 2)
    col = jax.lax.broadcasted_iota(jnp.int32, s_BNLM.shape, 3)
    return jnp.where(col <= row, s_BNLM, jnp.finfo(s_BNLM.dtype).min)


@jax.custom_vjp
def causal_attention(q_BNLC: jax.Array, k_BNMC: jax.Array, v_BNMC: jax.Array) -> jax.Array:
    """``softmax(q kᵀ / sqrt(C) + causal mask) v`` for ``[B, N, L, C]`` (M = L) → ``[B, N, L, C]``.

    Position l attends to positions m ≤ l; scores are computed and softmaxed in float32 whatever the
    inputs' dtype (float32 or bfloat16); the output and the gradients have the inputs' dtype.
    """
    return _attention_fwd(q_BNLC, k_BNMC, v_BNMC)[0]


def _attention_fwd(q_BNLC, k_BNMC, v_BNMC):
    s_BNLM = _causal_scores(q_BNLC, k_BNMC)
    e_BNLM = jnp.exp(s_BNLM - s_BNLM.max(-1, keepdims=True))
    p_BNLM = (e_BNLM / e_BNLM.sum(-1, keepdims=True)).astype(v_BNMC.dtype)
    return jnp.einsum("bnlm,bnmc->bnlc", p_BNLM, v_BNMC), (q_BNLC, k_BNMC, v_BNMC, p_BNLM)


def _attention_bwd(res, do_BNLC):
    q_BNLC, k_BNMC, v_BNMC, p_BNLM = res
    # dV and dK contract over the query axis: they take Pᵀ and dSᵀ swapped explicitly (in a benchmark
    # of this rule alone, 4 × 4 heads × 128², a little faster than contracting over P's query axis).
    dv_BNMC = jnp.einsum("bnml,bnlc->bnmc", jnp.swapaxes(p_BNLM, 2, 3), do_BNLC)
    # the softmax's backward in float32, like its forward (no-ops when everything is float32)
    dp_BNLM = jnp.einsum("bnlc,bnmc->bnlm", do_BNLC, v_BNMC, preferred_element_type=jnp.float32)
    p32_BNLM = p_BNLM.astype(jnp.float32)
    ds_BNLM = p32_BNLM * (dp_BNLM - (dp_BNLM * p32_BNLM).sum(-1, keepdims=True)) * (1.0 / math.sqrt(q_BNLC.shape[-1]))
    ds_BNLM = ds_BNLM.astype(q_BNLC.dtype)
    dq_BNLC = jnp.einsum("bnlm,bnmc->bnlc", ds_BNLM, k_BNMC)
    dk_BNMC = jnp.einsum("bnml,bnlc->bnmc", jnp.swapaxes(ds_BNLM, 2, 3), q_BNLC)
    return dq_BNLC, dk_BNMC, dv_BNMC.astype(v_BNMC.dtype)


causal_attention.defvjp(_attention_fwd, _attention_bwd)


def cached_attention(q_BNC: jax.Array, k_BNSC: jax.Array, v_BNSC: jax.Array, pos_B: jax.Array) -> jax.Array:
    """One query per row against S cached positions: ``softmax(q kᵀ / sqrt(C)) v`` over positions
    ``0..pos_B`` (int ``[B]``), the rest masked as :func:`causal_attention` masks the future.
    ``q: [B, N, C]``, ``k``/``v: [B, N, S, C]`` → ``[B, N, C]``; scores and softmax in float32, the
    output in ``v``'s dtype (the KV-cached decoder's attention, no gradient)."""
    s_BNS = jnp.einsum("bnc,bnsc->bns", q_BNC, k_BNSC, preferred_element_type=jnp.float32) * (
        1.0 / math.sqrt(q_BNC.shape[-1])
    )
    col = jax.lax.broadcasted_iota(jnp.int32, s_BNS.shape, 2)
    s_BNS = jnp.where(col <= pos_B[:, None, None], s_BNS, jnp.finfo(s_BNS.dtype).min)
    e_BNS = jnp.exp(s_BNS - s_BNS.max(-1, keepdims=True))
    p_BNS = (e_BNS / e_BNS.sum(-1, keepdims=True)).astype(v_BNSC.dtype)
    return jnp.einsum("bns,bnsc->bnc", p_BNS, v_BNSC)


HEAD_ROWS = 256  # rows of the head computed together in the training pass (a [256, V] block stays in cache)


def _xent_rows(x_TD, w_DV, labels_T):
    """Per-row ``logsumexp(x @ w) − (x @ w)[label]``, plus what the gradient needs: e = exp(l − m), s = Σe.
    The logits are float32 whatever the inputs' dtype (a bfloat16 matmul accumulates into float32)."""
    logits_TV = jnp.matmul(x_TD, w_DV, preferred_element_type=jnp.float32)
    m_T1 = jnp.max(logits_TV, axis=-1, keepdims=True)
    m_T1 = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m_T1), m_T1, 0.0))
    e_TV = jnp.exp(logits_TV - m_T1)
    s_T1 = jnp.sum(e_TV, axis=-1, keepdims=True)
    label_T = jnp.take_along_axis(logits_TV, labels_T[..., None], axis=-1)[..., 0]
    return (jnp.log(s_T1[..., 0]) + m_T1[..., 0]) - label_T, e_TV, s_T1


@jax.custom_vjp
def softmax_cross_entropy_head(x_TD: jax.Array, w_DV: jax.Array, labels_T: jax.Array) -> jax.Array:
    """Mean over rows of ``logsumexp(x @ w) − (x @ w)[label]``: the output projection and the loss.

    ``x: [..., D]``, ``w: [D, V]`` (float32 or bfloat16), ``labels: int[...]`` → scalar float32
    (nats): logits, softmax and loss in float32; the gradients in the inputs' dtypes. The value is
    ``optax.softmax_cross_entropy_with_integer_labels`` on the logits, then the mean.
    Differentiated, the forward pass also computes both gradients, :data:`HEAD_ROWS` rows at a time
    (the loss is a scalar, so they are the cotangent's multiples: the backward pass only scales
    them); the logits are never stored whole and the softmax is exponentiated once.
    """
    return jnp.mean(_xent_rows(x_TD, w_DV, labels_T)[0])


def _xent_fwd(x_TD, w_DV, labels_T):
    D, V = w_DV.shape
    x_RD, y_R = x_TD.reshape(-1, D), labels_T.reshape(-1)
    R = x_RD.shape[0]
    rows = HEAD_ROWS if R % HEAD_ROWS == 0 else R
    loss, dx, dw_DV = 0.0, [], jnp.zeros(w_DV.shape, jnp.float32)
    for i in range(0, R, rows):
        xc_RD, yc_R = x_RD[i : i + rows], y_R[i : i + rows]
        nll_R, e_RV, s_R1 = _xent_rows(xc_RD, w_DV, yc_R)
        loss = loss + jnp.sum(nll_R)
        p_RV = e_RV / s_R1
        onehot_RV = jax.lax.broadcasted_iota(jnp.int32, p_RV.shape, 1) == yc_R[:, None]
        g_RV = (jnp.where(onehot_RV, p_RV - 1.0, p_RV) * (1.0 / R)).astype(x_TD.dtype)
        dx.append(jnp.einsum("rv,dv->rd", g_RV, w_DV))
        dw_DV = dw_DV + jnp.einsum("rd,rv->dv", xc_RD, g_RV, preferred_element_type=jnp.float32)
    return loss / R, (jnp.concatenate(dx).reshape(x_TD.shape), dw_DV.astype(w_DV.dtype))


def _xent_bwd(res, ct):
    dx_TD, dw_DV = res
    return (dx_TD * ct).astype(dx_TD.dtype), (dw_DV * ct).astype(dw_DV.dtype), None


softmax_cross_entropy_head.defvjp(_xent_fwd, _xent_bwd)
