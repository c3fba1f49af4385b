"""The mixture-of-experts feed-forward layer shared by the text and vision families.

Top-k routing with a per-group expert capacity, written with dispatch and combine tensors and
einsums (GShard, Lepikhin et al. 2020, Sec. 2.2 and Alg. 1; Switch Transformer, Fedus et al. 2021,
Sec. 2.1-2.2), never a Python loop over experts:

* the router is one float32 matrix ``[D, E]``; its softmax probabilities pick each token's k
  experts (``jax.lax.top_k``); with k > 1 the k gates are renormalised to sum to 1 (GShard);
* each group (one row of the batch) gives each expert C slots, C = ⌈capacity_factor · k · S / E⌉
  (at most S), S the group's real tokens (see padding below). Slots are taken first by every
  token's first choice, in token order, then by the second choices (GShard's priority). A choice
  that finds its expert full is dropped: the token keeps its residual path for that choice (its
  output gets nothing from it) and the drop is counted. ``capacity_factor = None`` is dropless:
  C = S, which no expert can exceed because a token's k choices are distinct experts;
* the load-balancing loss of Switch Transformer (its Eq. 4 without α): E · Σ_e f_e · P_e, with
  f_e the fraction of the group's routing choices (all k, before capacity) that picked expert e and
  P_e the mean router probability of e; it equals 1 for a perfectly uniform router and grows with
  imbalance. The caller weights it (α);
* the router z-loss of ST-MoE (Zoph et al. 2022, Eq. 5): mean over tokens of (log Σ_e exp x_e)²,
  which keeps the router logits small. Also weighted by the caller;
* several MoE layers: :func:`auxiliary_loss` weighs the **mean** of the per-layer losses over the
  MoE layers (not their sum), so ``aux_loss_weight`` and ``z_loss_weight`` mean the same at any
  depth and ``moe_every``;
* padding (a token mask ``[G, S]``, 1 for a real token, e.g. a right-padded fine-tuning row): a
  padding token picks no expert, takes no slot and gets zero output (its residual path only); the
  capacity is counted from each group's real tokens (a row padded to any length routes as the
  same row unpadded) and the load, router probability, aux and z losses and the dropped fraction
  are means over real tokens only. No mask: every token is real (packed pretraining rows, images).

Shape legend: G groups (rows of the batch), S tokens per group, D width, E experts, C slots per
expert per group, F expert hidden width, K choices per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers.lora import project

STATS = "moe_stats"  # the name each MoE layer sows its statistics under (nnx.Intermediate)


def expert_capacity(tokens_per_group: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert per group: ⌈capacity_factor · k · S / E⌉ clipped to [1, S]; S if dropless."""
    if capacity_factor is None:
        return tokens_per_group
    c = math.ceil(capacity_factor * top_k * tokens_per_group / num_experts)
    return max(1, min(tokens_per_group, c))


def group_capacity(
    real_G: jax.Array, max_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None
) -> jax.Array:
    """:func:`expert_capacity` of each group's real token count ``int32[G]`` (each in [0, max_tokens]),
    as ``int32[G]``: read from a table of :func:`expert_capacity` (the same rounding as a group of
    that many tokens without padding); at most ``expert_capacity(max_tokens, …)``."""
    table = [0] + [expert_capacity(n, num_experts, top_k, capacity_factor) for n in range(1, max_tokens + 1)]
    return jnp.asarray(table, jnp.int32)[real_G]


def route(
    logits_GSE: jax.Array,
    top_k: int,
    capacity: int,
    mask_GS: jax.Array | None = None,
    capacity_G: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Top-k routing with expert capacity, from router logits ``float32[G, S, E]``.

    ``capacity``: C, the slots per expert the dispatch tensors hold. ``mask_GS`` (bool or float
    ``[G, S]``, 1 for a real token; None: all real): padding picks no expert, takes no slot and is
    left out of every statistic. ``capacity_G`` (``int32[G]``, each ≤ C; None: C for every group):
    the slots per expert each group may fill (:func:`group_capacity` of its real tokens).

    Returns ``(dispatch, combine, stats)``: ``dispatch float32[G, S, E, C]`` is 1 where token s of
    group g takes slot c of expert e; ``combine float32[G, S, E, C]`` holds the token's gate there
    (its router probability, renormalised over its k choices when k > 1); ``stats``:
    ``load float32[E]`` (f_e, fraction of routing choices per expert, before capacity; sums to 1),
    ``prob float32[E]`` (P_e, mean router probability), ``aux`` (E · Σ f_e P_e), ``z`` (mean squared
    log-sum-exp of the logits) and ``dropped`` (fraction of routing choices beyond capacity), all
    float32 scalars but ``load`` and ``prob``; every one a mean over the real tokens of all groups
    (0 for the scalars when there is none).
    """
    G, S, E = logits_GSE.shape
    K, C = top_k, capacity
    probs_GSE = jax.nn.softmax(logits_GSE, axis=-1)
    gates_GSK, experts_GSK = jax.lax.top_k(probs_GSE, K)
    if K > 1:
        gates_GSK = gates_GSK / gates_GSK.sum(axis=-1, keepdims=True)
    real_GS = jnp.ones((G, S), jnp.float32) if mask_GS is None else (mask_GS > 0).astype(jnp.float32)
    # padding chooses no expert: it takes no slot, queues before nobody and is counted nowhere
    choice_KGSE = jnp.moveaxis(jax.nn.one_hot(experts_GSK, E, dtype=jnp.float32), 2, 0) * real_GS[None, :, :, None]
    # Slot of each choice in its expert: earlier tokens of the same choice rank first, and every
    # first choice ranks before every second choice (the running count per expert over k, then s).
    per_choice_KGE = choice_KGSE.sum(axis=2)
    earlier_KGE = jnp.cumsum(per_choice_KGE, axis=0) - per_choice_KGE
    slot_KGSE = jnp.cumsum(choice_KGSE, axis=2) - 1.0 + earlier_KGE[:, :, None, :]
    cap_G = jnp.full((G,), C, jnp.int32) if capacity_G is None else jnp.minimum(capacity_G, C)
    kept_KGSE = choice_KGSE * (slot_KGSE < cap_G[None, :, None, None])
    slot_KGS = (slot_KGSE * choice_KGSE).sum(axis=-1).astype(jnp.int32)
    slot_KGSC = jax.nn.one_hot(slot_KGS, C, dtype=jnp.float32) * kept_KGSE.sum(axis=-1, keepdims=True)
    dispatch_GSEC = jnp.einsum("kgse,kgsc->gsec", kept_KGSE, slot_KGSC)
    gates_KGS = jnp.moveaxis(gates_GSK, 2, 0)
    combine_GSEC = jnp.einsum("kgs,kgse,kgsc->gsec", gates_KGS, kept_KGSE, slot_KGSC)

    n_real = jnp.maximum(real_GS.sum(), 1.0)
    load_E = choice_KGSE.sum(axis=(0, 1, 2)) / (K * n_real)
    prob_E = jnp.einsum("gse,gs->e", probs_GSE, real_GS) / n_real
    stats = {
        "load": load_E,
        "prob": prob_E,
        "aux": E * jnp.sum(load_E * prob_E),
        "z": jnp.sum(jnp.square(jax.nn.logsumexp(logits_GSE, axis=-1)) * real_GS) / n_real,
        "dropped": (choice_KGSE.sum() - kept_KGSE.sum()) / (K * n_real),
    }
    return dispatch_GSEC, combine_GSEC, stats


class MoE(nnx.Module):
    """E SwiGLU experts behind a top-k router:
    ``__call__(x: float32[G, S, D], mask: bool|float[G, S] | None = None) -> float32[G, S, D]``.

    Each row of the batch is one routing group. ``mask`` marks the real tokens (1) and the padding
    (0; routed nowhere, output 0, no slot, no statistic); each group's capacity is counted from its
    real tokens (:func:`group_capacity`); None: every token is real. Parameters:
    ``router/kernel [D, E]``, ``gate`` and ``up [E, D, F]``, ``down [E, F, D]`` (initialised as
    :class:`models.layers.mlp.SwiGLU`'s, one draw per expert). Each call sows its routing
    statistics (see :func:`route`) as ``nnx.Intermediate`` under :data:`STATS`, read with
    ``nnx.capture`` by the objective.
    ``capacity_factor``: None for dropless routing. Raises ``ValueError`` for k outside [1, E].
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        n_layers: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float | None,
        rngs: nnx.Rngs,
    ):
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be between 1 and the number of experts ({num_experts})")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / (2 * n_layers) ** 0.5)
        self.router = nnx.Linear(d_model, num_experts, use_bias=False, kernel_init=init, rngs=rngs)
        E, D, F = num_experts, d_model, d_ff
        self.gate = nnx.Param(init(rngs.params(), (E, D, F)))
        self.up = nnx.Param(init(rngs.params(), (E, D, F)))
        self.down = nnx.Param(out_init(rngs.params(), (E, F, D)))

    def __call__(self, x_GSD: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        G, S, D = x_GSD.shape
        C = expert_capacity(S, self.num_experts, self.top_k, self.capacity_factor)
        capacity_G = (
            None
            if mask is None
            else group_capacity(
                (mask > 0).sum(axis=1).astype(jnp.int32), S, self.num_experts, self.top_k, self.capacity_factor
            )
        )
        # the router in float32 whatever the compute dtype (Switch Transformer's selective precision, Sec. 2.4)
        # (x in float32 promotes the product to float32 with a bfloat16 kernel too)
        logits_GSE = project(self.router, x_GSD.astype(jnp.float32))
        dispatch_GSEC, combine_GSEC, stats = route(logits_GSE, self.top_k, C, mask, capacity_G)
        self.sow(nnx.Intermediate, STATS, stats)
        # the experts in the compute dtype (no-ops in float32); the gates' gradient reaches the router
        dispatch_GSEC, combine_GSEC = dispatch_GSEC.astype(x_GSD.dtype), combine_GSEC.astype(x_GSD.dtype)
        x_EGCD = jnp.einsum("gsec,gsd->egcd", dispatch_GSEC, x_GSD)
        h_EGCF = jax.nn.silu(jnp.einsum("egcd,edf->egcf", x_EGCD, self.gate[...])) * jnp.einsum(
            "egcd,edf->egcf", x_EGCD, self.up[...]
        )
        y_EGCD = jnp.einsum("egcf,efd->egcd", h_EGCF, self.down[...])
        return jnp.einsum("gsec,egcd->gsd", combine_GSEC, y_EGCD)


def collect_stats(intermediates) -> list[dict[str, jax.Array]]:
    """The statistics every MoE layer sowed in one captured call, in layer order.

    ``intermediates``: the ``nnx.Intermediate`` state returned by ``nnx.capture``. Layers are ordered
    by their path in the module tree (block index first). A layer called twice keeps its last call.
    """
    found: list[tuple[tuple, dict]] = []

    def walk(node, path):
        if isinstance(node, dict) or hasattr(node, "items"):
            for key, child in node.items():
                if key == STATS:
                    values = child if isinstance(child, (tuple, list)) else (child,)
                    found.append((path, values[-1]))
                else:
                    walk(child, path + (key,))

    walk(nnx.to_pure_dict(intermediates), ())
    found.sort(key=lambda item: tuple((0, k) if isinstance(k, int) else (1, str(k)) for k in item[0]))
    return [stats for _, stats in found]


# -- what every MoE model kind shares (cfg: a config with the fields of configs.model.MoEFields,
#    plus d_model, d_ff and n_layers) ----------------------------------------------------------------


def moe_blocks(cfg) -> list[int]:
    """Indices (from 0) of the blocks with an MoE layer: every ``moe_every``-th block (Switch,
    GShard and V-MoE alternate dense and MoE blocks)."""
    return [i for i in range(cfg.n_layers) if (i + 1) % cfg.moe_every == 0]


def mlp_factory(cfg, rngs: nnx.Rngs) -> Callable[[int], nnx.Module]:
    """``make_mlp(i)``: an :class:`MoE` for the blocks of :func:`moe_blocks`, a SwiGLU of width
    ``d_ff`` for the others; experts have width ``expert_d_ff`` (``d_ff`` when unset)."""
    from models.layers.mlp import SwiGLU

    at = set(moe_blocks(cfg))
    f_e = cfg.expert_d_ff or cfg.d_ff

    def make_mlp(i: int) -> nnx.Module:
        if i in at:
            return MoE(cfg.d_model, f_e, cfg.n_layers, cfg.n_experts, cfg.top_k, cfg.capacity_factor, rngs)
        return SwiGLU(cfg.d_model, cfg.d_ff, cfg.n_layers, rngs)

    return make_mlp


def idle_expert_params(cfg) -> int:
    """Parameters one token does not use: the E − k unchosen experts (3·D·F_e each) of every MoE block."""
    return len(moe_blocks(cfg)) * (cfg.n_experts - cfg.top_k) * 3 * cfg.d_model * (cfg.expert_d_ff or cfg.d_ff)


def auxiliary_loss(cfg, stats: list[dict[str, jax.Array]]) -> jax.Array:
    """aux_loss_weight · mean_layers aux + z_loss_weight · mean_layers z (Switch Transformer Eq. 4
    and ST-MoE Eq. 5, **averaged** over the MoE layers, so a weight means the same at any depth):
    what the objective adds to the cross entropy, a float32 scalar. ``stats``: one dict per MoE
    layer (:func:`collect_stats`); raises ``ValueError`` if empty."""
    if not stats:
        raise ValueError("auxiliary_loss needs the statistics of at least one MoE layer")
    aux = jnp.mean(jnp.stack([s["aux"] for s in stats]))
    z = jnp.mean(jnp.stack([s["z"] for s in stats]))
    return cfg.aux_loss_weight * aux + cfg.z_loss_weight * z
