"""Wall time under a stated interconnect: what each method's run would take if its workers sat on
separate hosts joined by the links of ``network`` (the config section), from the compute time this
host measured and the bytes the run counted. Plain arithmetic, no Prefect, no JAX. The model (DP's
ring all-reduce, Patarasuk & Yuan 2009; DiLoCo's transfers in line with its steps, the merge due back within τ
steps, paper §3) and its limits: docs/interconnect.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from reports.common import num

if TYPE_CHECKING:
    from configs.schema import ExperimentConfig

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Link:
    """One worker's link: ``bandwidth_gbps`` (Gbit/s, each direction), ``latency_ms`` (one way, per
    message), ``label`` (what it models, e.g. "links between datacenters"). Raises ``ValueError`` for
    a bandwidth ≤ 0 or a negative latency."""

    bandwidth_gbps: float
    latency_ms: float
    label: str = ""

    def __post_init__(self):
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"network.bandwidth_gbps must be > 0 Gbit/s, got {self.bandwidth_gbps}")
        if self.latency_ms < 0:
            raise ValueError(f"network.latency_ms must be ≥ 0 ms, got {self.latency_ms}")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * GBIT

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3


def assumption(link: Link, dp_overlap: float = 0.0) -> str:
    """The line every modelled figure carries, e.g. ``modelled: links between datacenters, 1 Gbit/s
    each way, 20 ms one way; compute as measured on this host; DP all-reduce not overlapped``."""
    what = f"{link.label}, " if link.label else ""
    dp = "not overlapped" if dp_overlap == 0 else f"{dp_overlap:.0%} of its compute hides the all-reduce"
    return (
        f"modelled: {what}{link.bandwidth_gbps:g} Gbit/s each way, {link.latency_ms:g} ms one way; "
        f"compute as measured on this host; DP all-reduce {dp}"
    )


def ring_allreduce_s(grad_bytes: float, workers: int, link: Link) -> float:
    """Seconds of one ring all-reduce of ``grad_bytes`` over ``workers`` (0 for one worker):
    ``2(W−1)·(latency + G/(W·bandwidth))`` (Patarasuk & Yuan 2009)."""
    if workers <= 1:
        return 0.0
    return 2 * (workers - 1) * (link.latency_s + grad_bytes / (workers * link.bytes_per_s))


def dp_step_s(compute_s: float, grad_bytes: float, workers: int, link: Link, dp_overlap: float = 0.0) -> dict:
    """One DP step: ``{"compute_s", "comm_s" (the all-reduce), "step_s", "keep_up_gbps"}``."""
    comm = ring_allreduce_s(grad_bytes, workers, link)
    per_worker = 2 * (workers - 1) / workers * grad_bytes if workers > 1 else 0.0  # bytes each way
    return {
        "compute_s": compute_s,
        "comm_s": comm,
        "step_s": compute_s + max(0.0, comm - dp_overlap * compute_s),
        "keep_up_gbps": per_worker / compute_s / GBIT if compute_s > 0 else None,
    }


def diloco_step_s(
    compute_s: float,
    up_bytes_per_step: float,
    down_bytes_per_step: float,
    fragments: int,
    sync_every: int,
    link: Link,
) -> dict:
    """One learner step: ``{"compute_s", "comm_s" (a fragment's round trip), "transfer_s" (per step, on
    the learner's clock), "step_s", "keep_up_gbps"}``; bytes per learner step, each direction.

    The learner moves its bytes in line with its steps (``diloco.learner.run_learner``: the store's
    put in ``Learner.send``, its gets in ``Learner.refresh``), so they add to each step rather than
    hide behind compute: ``transfer_s = (up + down)/B + 2·latency·(3 + 2/s)`` with s = H/P steps
    between two sends: each step two reads of the store's state (the token claim, the refresh) and
    the claim's write, and every s steps one fragment sent and one fetched, each request a round trip
    (measured on emulated links, latency 0: benchmarks/results/emulated_default_cpu-2core_2026-12-05.md).
    Once sent, the merge is due back within τ ≥ 1 steps (paper §3): what is left of its round trip
    after the upload, the syncer's notice (2·latency; its merge is outside this model), is shorter
    than one step's six latencies, so it never waits."""
    per_sync = sync_every / fragments  # learner steps between two of its sends
    up, down = up_bytes_per_step * per_sync, down_bytes_per_step * per_sync  # one fragment, each way
    round_trip = 2 * link.latency_s + (up + down) / link.bytes_per_s
    transfer = (up_bytes_per_step + down_bytes_per_step) / link.bytes_per_s + 2 * link.latency_s * (3 + 2 / per_sync)
    return {
        "compute_s": compute_s,
        "comm_s": round_trip,
        "transfer_s": transfer,
        "step_s": compute_s + transfer,
        "keep_up_gbps": max(up_bytes_per_step, down_bytes_per_step) / compute_s / GBIT if compute_s > 0 else None,
    }


def modelled_curve(curve: list[dict], tokens_per_step: float, extra_s: float) -> list[dict]:
    """The held-out curve (rows with ``tokens``, ``wall_s`` and ``val/loss``) against modelled seconds:
    ``modelled_s`` = the measured ``wall_s`` + the steps taken by then (tokens / tokens per step of the
    whole system) × ``extra_s``, the seconds the links add to each step."""
    return [
        {**r, "modelled_s": r["wall_s"] + r["tokens"] / tokens_per_step * extra_s}
        for r in curve
        if r.get("tokens") is not None and r.get("val/loss") is not None and r.get("wall_s") is not None
    ]


def time_to_loss(curve: list[dict], target: float) -> float | None:
    """The first modelled second at which the curve reaches ``target`` (linear between evaluations),
    or None if it never does."""
    prev = None
    for r in curve:
        if r["val/loss"] <= target:
            if prev is None or prev["val/loss"] == r["val/loss"]:
                return r["modelled_s"]
            f = (prev["val/loss"] - target) / (prev["val/loss"] - r["val/loss"])
            return prev["modelled_s"] + f * (r["modelled_s"] - prev["modelled_s"])
        prev = r
    return None


def interconnect_figures(config: ExperimentConfig | None, dp: dict | None, diloco: dict | None) -> dict | None:
    """Both methods' figures under the run's ``network`` section (``config``: the typed config): per
    method ``compute_s`` (measured, per step), ``comm_s`` (DP: the all-reduce; DiLoCo: a fragment's
    round trip), ``extra_s`` (what the links add to each step), ``step_s``, ``keep_up_gbps``,
    ``measured_wall_s``, ``modelled_wall_s`` and ``curve`` (the held-out curve with ``modelled_s``),
    plus ``time_to_dp_final_s`` (modelled seconds to DP's final held-out loss; None: not reached) and
    the ``assumption`` line. ``dp`` / ``diloco``: ``{"summary", "curve"}`` of the method, or None.
    None without a ``network`` section or a method to model; a method without steps, wall time or
    tokens is left out."""
    if config is None or "network" not in config.model_fields_set:
        return None
    net = config.network
    same_host = net.bandwidth_gbps is None and not net.emulate
    # emulated datacenters (network.emulate): the run trained across the links, its times are measured
    link = None if same_host or net.emulate else Link(net.bandwidth_gbps, net.latency_ms, net.label)
    overlap = net.dp_overlap
    out: dict = {"same_host": same_host, "kind": "measured" if net.emulate else "modelled", "methods": {}}
    if link:
        out["short"] = f"{link.bandwidth_gbps:g} Gbit/s, {link.latency_ms:g} ms links"
        out["assumption"] = assumption(link, overlap)
    else:
        out["short"] = "this host"
        out["assumption"] = "modelled: every worker on this host (no network); the measured figures"
    if net.emulate:
        rate = "unshaped links" if net.bandwidth_gbps is None else f"{net.bandwidth_gbps:g} Gbit/s links"
        out["short"] = f"emulated datacenters, {rate}, latency not emulated"
        out["assumption"] = (
            f"measured: each learner and DP host trained in an emulated datacenter ({rate} each way, tc tbf; "
            "latency not emulated: no netem in this kernel), the syncer and its store in the hub; this run's own times"
        )
    for method, rec in (("dp", dp), ("diloco", diloco)):
        s = (rec or {}).get("summary") or {}
        steps, wall, tokens = num(s.get("steps")), num(s.get("wall_s")), num(s.get("tokens"))
        if not steps or not wall or not tokens:
            continue
        curve = (rec or {}).get("curve") or []
        sent, received = num(s.get("bytes_to_syncer")) or 0.0, num(s.get("bytes_from_syncer")) or 0.0
        if method == "dp":
            workers = config.dp.workers
            compute = (wall - sum(num(r.get("eval_s")) or 0.0 for r in curve)) / steps  # DP pauses to evaluate
            grad = sent / (2 * (workers - 1) * steps) if workers > 1 else 0.0  # sent: 2(W−1)·G a step in all
            fig = dp_step_s(compute, grad, workers, link, overlap) if link else None
            system_steps = steps
        else:
            d = config.diloco
            system_steps = steps / d.learners  # the summary's steps: all learners' steps together, side by side
            compute = (wall - (num(s.get("startup_s")) or 0.0)) / system_steps
            fig = (
                diloco_step_s(compute, sent / steps, received / steps, d.fragments, d.sync_every, link)
                if link
                else None
            )
        if fig is None:  # same host: the measured figures
            fig = {"compute_s": compute, "comm_s": 0.0} | ({"transfer_s": 0.0} if method == "diloco" else {})
            fig |= {"step_s": compute, "keep_up_gbps": None}
        per_step_tokens = tokens / system_steps
        extra = fig["step_s"] - fig["compute_s"]
        out["methods"][method] = {
            **fig,
            "extra_s": extra,
            "measured_wall_s": wall,
            "modelled_wall_s": wall + system_steps * extra,
            "curve": modelled_curve(curve, per_step_tokens, extra),
        }
    if not out["methods"]:
        return None
    dp_curve = out["methods"].get("dp", {}).get("curve") or []
    target = dp_curve[-1]["val/loss"] if dp_curve else None
    out["time_to_dp_final_s"] = {
        m: time_to_loss(f["curve"], target) if target is not None else None for m, f in out["methods"].items()
    }
    return out
