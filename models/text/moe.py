"""The mixture-of-experts decoder LM (``kind: moe_lm``): the dense LM with an MoE layer in place of
the MLP of every ``moe_every``-th block (blocks moe_every, 2·moe_every, … counting from 1, as
Switch Transformer and GShard alternate dense and MoE layers).

The objective adds the load-balancing and z losses, averaged over the MoE layers, to the cross
entropy, with the configured weights; the held-out loss the loops report is the cross entropy alone
(``ce``), comparable with the dense LM's. A right-padded fine-tuning batch's padding
(:func:`models.text.dense.input_mask`) reaches the routers: it takes no expert capacity and is left
out of the routing statistics, so padding changes neither the real tokens' loss nor the MoE figures.

Shape legend: B batch, L sequence length, D d_model, V vocabulary, E experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers.moe import auxiliary_loss, collect_stats, idle_expert_params, mlp_factory, moe_blocks
from models.spec import BatchLayout, InputShape, ModelSpec, count_params, register
from models.text.dense import DecoderLM, input_mask, lm_inputs, lm_loss, lm_targets


def build_moe_lm(cfg, vocab_size: int, max_len: int, rngs: nnx.Rngs) -> DecoderLM:
    """A :class:`DecoderLM` whose blocks :func:`models.layers.moe.moe_blocks` hold MoE layers."""
    return DecoderLM(cfg, vocab_size, max_len, rngs, make_mlp=mlp_factory(cfg, rngs))


def moe_metrics(stats: list[dict[str, jax.Array]], layers: list[int]) -> dict[str, jax.Array]:
    """Scalar metrics of the MoE layers, each over the real (unpadded) tokens of the batch: means
    over layers (``moe/aux``, ``moe/z``, ``moe/dropped``,
    ``moe/max_load``: the busiest expert's share × E, 1 when balanced) and per layer
    (``moe/<block>/load/<e>``: fraction of routing choices that picked expert e; ``moe/<block>/dropped``)."""
    out = {
        "moe/aux": jnp.mean(jnp.stack([s["aux"] for s in stats])),
        "moe/z": jnp.mean(jnp.stack([s["z"] for s in stats])),
        "moe/dropped": jnp.mean(jnp.stack([s["dropped"] for s in stats])),
        "moe/max_load": jnp.mean(jnp.stack([s["load"].max() * s["load"].shape[0] for s in stats])),
    }
    for block, s in zip(layers, stats, strict=True):
        out[f"moe/{block}/dropped"] = s["dropped"]
        for e in range(s["load"].shape[0]):
            out[f"moe/{block}/load/{e}"] = s["load"][e]
    return out


def make_objective(cfg):
    """``objective(model, batch) -> (loss, metrics)`` for a packed ``int32[B, L+1]`` or a fine-tuning
    ``{"ids", "mask"}`` batch (:func:`models.text.dense.lm_loss`): loss = cross entropy +
    aux_loss_weight · mean_layers aux + z_loss_weight · mean_layers z (Switch Transformer Eq. 4 and
    ST-MoE Eq. 5, averaged over the MoE layers: :func:`models.layers.moe.auxiliary_loss`); metrics:
    ``ce`` and :func:`moe_metrics`. A fine-tuning batch's padding (:func:`models.text.dense.input_mask`)
    is routed nowhere and counted nowhere."""
    layers = moe_blocks(cfg)

    def objective(model, batch):
        x_BLD, intermediates = nnx.capture(model.features, nnx.Intermediate)(lm_inputs(batch), input_mask(batch))
        ce = lm_loss(x_BLD, model.head_kernel(), batch)
        stats = collect_stats(intermediates)
        return ce + auxiliary_loss(cfg, stats), {"ce": ce, **moe_metrics(stats, layers)}

    return objective


def param_counts(cfg, vocab_size: int) -> tuple[int, int]:
    """(total, active) parameters: active counts k of the E experts of each MoE layer (what one
    token uses), the router and every shared tensor; norms included in both."""
    abstract = nnx.eval_shape(lambda: build_moe_lm(cfg, vocab_size, 8, nnx.Rngs(0)))
    total = count_params(abstract)
    return total, total - idle_expert_params(cfg)


def flops_per_token(cfg, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token, active only: 6·N_active_matmul + 12·n_layers·d_model·L.

    As the dense LM's (Kaplan et al. 2020; attention over the full context as in PaLM, App. B), with
    each MoE layer counting its router (D·E) and k experts' SwiGLU (3·D·F_e each) in place of the
    MLP. The dispatch and combine einsums (≈ 4·S·E·C·D per group) are routing overhead, not model
    FLOPs, and are left out, as MoE MFU figures in the field do.
    """
    d, n = cfg.d_model, cfg.n_layers
    f_e = cfg.expert_d_ff or cfg.d_ff
    n_moe = len(moe_blocks(cfg))
    mlp = (n - n_moe) * 3 * d * cfg.d_ff + n_moe * (d * cfg.n_experts + cfg.top_k * 3 * d * f_e)
    matmul_params = n * 4 * d * d + mlp + d * vocab_size
    return 6.0 * matmul_params + 12.0 * n * d * seq_len


@register("moe_lm")
def build_moe_lm_spec(cfg, shape: InputShape) -> ModelSpec:
    """Spec of the MoE LM for a tokenizer of ``shape.vocab_size`` and rows of ``shape.seq_len`` + 1
    tokens. Raises ``ValueError`` if either is missing. ``extras``: ``active_params``,
    ``total_params``, ``moe_layers`` (block indices)."""
    if not shape.vocab_size or not shape.seq_len:
        raise ValueError("a moe_lm needs the data's vocab_size and seq_len")
    V, L = shape.vocab_size, shape.seq_len

    def init(seed: int) -> DecoderLM:
        return build_moe_lm(cfg, V, L, nnx.Rngs(seed))

    total, active = param_counts(cfg, V)
    return ModelSpec(
        kind="moe_lm",
        config=cfg,
        init=init,
        objective=make_objective(cfg),
        targets=lm_targets,
        batch=BatchLayout(dtype="int32", row_shape=(L + 1,), unit="tokens", units_per_row=L),
        params=total,
        flops_per_unit=flops_per_token(cfg, V, L),
        heldout="ce",
        extras={"active_params": active, "total_params": total, "moe_layers": moe_blocks(cfg)},
    )
