"""Bytes on the wire: every byte figure of a method, computed once (pure; no I/O).

Payload bytes (tensor bytes, no framing), summed over all learners/workers and attempts; "per"
figures are that sum ÷ M, "per token" figures that sum ÷ the method's training tokens. Who counts
what: ``reports.common.BYTES_CONVENTION``; docs/report.md ("Bytes on the wire").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reports.common import NOT_RUN, nested, num

if TYPE_CHECKING:
    from configs.methods import DiLoCoConfig
    from configs.schema import ExperimentConfig

NO_SYNCER = "n/a (no syncer)"


@dataclass(frozen=True)
class ByteSettings:
    """What the byte figures read of the config: ``diloco`` (M, P, the wire format), DP's ``dp.workers``
    (W) and budget units per DP step (``tokens_per_dp_step``: DP's batch × ``data.seq_len``; images: × 1)."""

    diloco: DiLoCoConfig
    dp_workers: int
    tokens_per_dp_step: int

    @classmethod
    def of(cls, config: ExperimentConfig | None) -> ByteSettings | None:
        return None if config is None else cls(config.diloco, config.dp.workers, config.tokens_per_dp_step)


def _div(x: float | int | None, n: int | None) -> float | int | None:
    """x / n, an int when it divides evenly; None when either is missing."""
    if x is None or not n:
        return None
    return int(x) // n if float(x).is_integer() and int(x) % n == 0 else x / n


def _count(value: int | None, summary: dict | None, hp_key: str) -> int | None:
    """A count from the run's config (``value``), else the summary's hyperparameter ``hp_key``."""
    v = num(value) if num(value) is not None else num(nested(summary, ("hyperparameters", hp_key)))
    return int(v) if v else None


def fragments(diloco: DiLoCoConfig | None, summary: dict | None) -> int | None:
    """P, the number of fragments: ``diloco.fragments`` of the run's config (``diloco``), else the summary."""
    p = _count(diloco.fragments if diloco else None, summary, "fragments (P)")
    if p is None and summary is not None and isinstance(summary.get("fragment_bytes"), list):
        p = len(summary["fragment_bytes"]) or None
    return p


def wire_format(diloco: DiLoCoConfig | None, summary: dict | None) -> str | None:
    """The learners' wire format (``diloco.wire``, e.g. ``int4:64``): the config's if it sets one, else
    the summary's hyperparameter, else ``float32`` with a config (None without)."""
    if diloco is not None and "wire" in diloco.model_fields_set:
        return diloco.wire.spec
    hp = nested(summary, ("hyperparameters", "wire format (learner→syncer)"))
    return str(hp) if hp is not None else ("float32" if diloco is not None else None)


def dp_allreduce_per_token(settings: ByteSettings | None, summary: dict | None) -> dict | None:
    """What DP's per-step ring all-reduce of this model's float32 gradient sends per token: 2(W−1) × G
    bytes a step (W = ``dp.workers``; G = 4 × the summary's ``params``, else the sum of its
    ``fragment_bytes``) over DP's batch × ``units_per_row`` (``data.seq_len`` tokens; images: 1).
    Returns ``{"sent_per_token", "workers", "gradient_bytes", "tokens_per_step"}``, or None."""
    params, frag = num((summary or {}).get("params")), (summary or {}).get("fragment_bytes")
    G = 4 * int(params) if params else (sum(frag) if isinstance(frag, list) and frag else None)
    if not (G and settings is not None):
        return None
    W, tokens = settings.dp_workers, settings.tokens_per_dp_step
    per_step = 2 * (W - 1) * G
    return {"sent_per_token": per_step / tokens, "workers": W, "gradient_bytes": int(G), "tokens_per_step": tokens}


def syncer_bytes(
    settings: ByteSettings | None,
    summary: dict | None,
    merges: list[dict] | None,
    files: dict[str, str],
    notes: list[str],
    who: str,
    kind: str = "syncer",
) -> dict:
    """A learners-and-syncer method's byte figures: ``sent`` / ``received`` = summary
    ``bytes_to_syncer`` / ``bytes_from_syncer``, per learner = ÷ M; ``merged_in`` / ``published_out``
    = the merge log's ``bytes_in`` / ``bytes_out`` summed (None unless every record has the field,
    ``*_recorded`` in how many; without a log the summary's ``bytes_merged``); ``sent_per_token``;
    a syncer method (``kind`` "syncer", not "plain") also ``wire``, ``dp_allreduce``
    (:func:`dp_allreduce_per_token`) and ``sent_vs_dp`` (DP's sent per token ÷ this method's)."""
    M = _count(settings.diloco.learners if settings else None, summary, "learners (M)")
    sent, received = num((summary or {}).get("bytes_to_syncer")), num((summary or {}).get("bytes_from_syncer"))
    fig: dict[str, Any] = {
        "status": "ok" if summary is not None else NOT_RUN,
        "kind": kind,
        "learners": M,
        "sent": sent,
        "received": received,
        "total": sent + received if sent is not None and received is not None else None,
        "sent_per_learner": _div(sent, M),
        "received_per_learner": _div(received, M),
        "sent_per_token": _per_token(sent, summary),
        "merge_records": len(merges or []),
    }
    if kind == "syncer":
        fig["wire"] = wire_format(settings.diloco if settings else None, summary)
        fig["dp_allreduce"] = dp_allreduce_per_token(settings, summary)
        dp = fig["dp_allreduce"]
        fig["sent_vs_dp"] = dp["sent_per_token"] / fig["sent_per_token"] if dp and fig["sent_per_token"] else None
    for key, name in (("merged_in", "bytes_in"), ("published_out", "bytes_out")):
        vals = [v for m in (merges or []) if (v := num(m.get(name))) is not None]
        fig[key] = sum(vals) if merges and len(vals) == len(merges) else None
        fig[f"{key}_recorded"] = len(vals)
    fig["merged_in_source"] = f"{files['merges']} (bytes_in)" if merges else None
    summary_merged = num(summary.get("bytes_merged")) if summary else None
    if merges is None and summary_merged is not None:
        fig["merged_in"], fig["merged_in_source"] = summary_merged, f"{files['summary']} (bytes_merged)"
    elif summary_merged is not None and fig["merged_in"] is not None and summary_merged != fig["merged_in"]:
        notes.append(
            f"{who} summary bytes_merged {int(summary_merged):,} differs from the merge log's "
            f"bytes_in total {int(fig['merged_in']):,}; the report shows the merge log's."
        )
    return fig


def allreduce_bytes(learners: int | None, summary: dict | None, notes: list[str], who: str) -> dict:
    """A data-parallel method's byte figures (the ring all-reduce of the gradient, all workers):
    ``sent`` = summary ``bytes_to_syncer``, ``received`` = ``bytes_from_syncer``, ``total`` = their
    sum (= ``allreduce_bytes``); a summary with only ``allreduce_bytes`` is split evenly. Per worker
    = ÷ W (hyperparameter ``simulated workers``, or ``hosts`` for a job of several hosts, else
    ``learners``: the config's ``diloco.learners``, None without a config)."""
    hp = ("hyperparameters",)
    W = num(nested(summary, (*hp, "simulated workers"))) or num(nested(summary, (*hp, "hosts"))) or learners
    W = int(W) if W else None
    sent, received, allreduce = (
        num((summary or {}).get(k)) for k in ("bytes_to_syncer", "bytes_from_syncer", "allreduce_bytes")
    )
    if sent is None and received is None and allreduce is not None:
        sent = received = _div(allreduce, 2)
    total = sent + received if sent is not None and received is not None else allreduce
    if allreduce is not None and total is not None and total != allreduce:
        notes.append(
            f"{who} summary allreduce_bytes {int(allreduce):,} is not bytes_to_syncer + "
            f"bytes_from_syncer = {int(total):,} (a summary written before allreduce_bytes "
            "counted both directions); the report shows the sent and received fields."
        )
    return {
        "status": "ok" if summary is not None else NOT_RUN,
        "kind": "allreduce",
        "workers": W,
        "sent": sent,
        "received": received,
        "total": total,
        "sent_per_worker": _div(sent, W),
        "received_per_worker": _div(received, W),
        "sent_per_token": _per_token(sent, summary),
    }


def _per_token(sent: float | int | None, summary: dict | None) -> float | None:
    """sent ÷ the summary's training ``tokens`` (budget units); None when either is missing."""
    tokens = num((summary or {}).get("tokens"))
    return sent / tokens if sent is not None and tokens else None


_BOTH = "learners (DiLoCo) / ring model (DP)"  # who counts a figure both kinds of method have
BYTE_ROWS = (  # key, label, counted by, syncer figure, all-reduce figure (None: no syncer)[, format]
    (
        "bytes_sent",
        "bytes sent, all learners/workers (DiLoCo: learner→syncer submission payloads; DP: ring all-reduce sends)",
        _BOTH,
        "sent",
        "sent",
    ),
    (
        "bytes_received",
        "bytes received, all learners/workers (DiLoCo: syncer→learner pulled fragments; DP: ring all-reduce receives)",
        _BOTH,
        "received",
        "received",
    ),
    ("bytes_total", "bytes sent + received, all learners/workers (DP: the all-reduce bytes)", _BOTH, "total", "total"),
    ("bytes_sent_per_worker", "bytes sent per learner/worker (all ÷ M)", _BOTH, "sent_per_learner", "sent_per_worker"),
    (
        "bytes_received_per_worker",
        "bytes received per learner/worker (all ÷ M)",
        _BOTH,
        "received_per_learner",
        "received_per_worker",
    ),
    (
        "bytes_sent_per_token",
        "bytes sent per training token, all learners/workers (bytes sent ÷ tokens)",
        _BOTH,
        "sent_per_token",
        "sent_per_token",
        "{:,.1f}",
    ),
    ("bytes_merged_in", "merge-log bytes_in: submission bytes merged", "syncer", "merged_in", None),
    (
        "bytes_published_out",
        "merge-log bytes_out: published, fragment bytes × M per merge",
        "syncer",
        "published_out",
        None,
    ),
)


def byte_cell(fig: dict, syncer_key: str, allreduce_key: str | None) -> Any:
    """One cell of a bytes row: the method's figure (``syncer_key``; all-reduce: ``allreduce_key``), "not run",
    "n/a (no syncer)", or "not recorded (in n of N merge records)" for a merge-log total some records lack."""
    if fig["kind"] == "allreduce" and allreduce_key is None:
        return NO_SYNCER
    if fig["status"] != "ok":
        return NOT_RUN
    key = allreduce_key if fig["kind"] == "allreduce" else syncer_key
    if key in ("merged_in", "published_out") and fig[key] is None and fig[f"{key}_recorded"]:
        return f"not recorded (in {fig[f'{key}_recorded']} of {fig['merge_records']} merge records)"
    return fig.get(key)
