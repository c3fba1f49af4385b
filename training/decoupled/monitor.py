"""The flow's view of a running Decoupled DiLoCo stage, from the exchange and the logs (no JAX, no
Prefect, writes nothing): :func:`live_view` (each learner as the syncer sees it, and the totals) and
:func:`learners_gone` (why the learners stopped before the budget was spent, in one phrase)."""

from __future__ import annotations

import time
from pathlib import Path

from configs.schema import ExperimentConfig
from diloco.syncer_loop import liveness
from run.layout import RunLayout
from run.metrics import read_jsonl
from training.decoupled import METHOD, STAGE


def live_view(cfg: ExperimentConfig, exchange, run_dir: str | Path) -> tuple[list[dict], dict]:
    """The syncer's-eye view of a running DiLoCo run, for a live artifact: one row per learner
    (alive as the syncer judges it from heartbeats, ``diloco.syncer_loop.liveness``; status,
    attempt, inner step, tokens processed, bytes sent and received, seconds since its last
    heartbeat, process id) and the totals: global versions, merges, tokens claimed, tokens merged
    (Σ over the merge log of the contributors' token counters ÷ P, the model-level tokens in Θ).
    Reads the exchange and ``metrics/merges.jsonl``; writes nothing."""
    live, down = liveness(exchange, cfg.diloco.heartbeat_timeout_s)
    now = time.monotonic()
    rows = []
    beats = exchange.learners()
    for m in range(cfg.diloco.learners):
        b = beats.get(m, {})
        state = "alive" if m in live else down.get(m, b.get("status", "not started"))
        rows.append(
            {
                "learner": m,
                "state": state,
                "attempt": b.get("attempt", 1 if b else None),
                "step": b.get("step"),
                "tokens": b.get("processed"),
                "bytes sent": b.get("bytes_to_syncer"),
                "bytes received": b.get("bytes_from_syncer"),
                "heartbeat age (s)": round(now - b["last_seen"], 1) if "last_seen" in b else None,
                "pid": b.get("pid"),
            }
        )
    merges = read_jsonl(RunLayout(run_dir).metrics(STAGE, METHOD, "merges"))
    versions = exchange.versions()
    totals = {
        "alive": len(live),
        "learners": cfg.diloco.learners,
        "versions": versions,
        "merges": sum(versions),
        "tokens claimed": exchange.claimed_tokens,
        "tokens merged": round(sum(sum(r.get("tokens") or []) for r in merges) / max(len(versions), 1)),
        "bytes merged": int(sum(r.get("bytes_in") or 0 for r in merges)),
    }
    return rows, totals


def learners_gone(
    learners: dict[int, dict], num_learners: int, errors: dict[int, str] | None = None, retries: int | None = None
) -> str:
    """Why a DiLoCo stage's learners stopped before its budget was spent, in one phrase (for
    ``training.common.budget_status``): how each learner ended, from its last heartbeat
    (``learners``: the exchange's view, learner → status, attempt, step, reason) or, for a learner
    that never reported to the exchange (its worker could not even start the task), from
    ``errors`` (learner → the task's error). ``retries``: ``diloco.learner_retries``, named in the
    phrase. Learner order; no Prefect, no I/O."""
    errors = errors or {}
    parts = []
    for m in range(num_learners):
        info = learners.get(m)
        if info is None:
            parts.append(
                f"learner {m} failed before its first step, never reporting to the exchange "
                f"({errors.get(m, 'no reason recorded')})"
            )
            continue
        status = info.get("status")
        verb = "failed" if status == "down" else f"ended {status or 'without a status'}"
        step = int(info.get("step") or 0)
        at = f"at local step {step}" if step else "before its first step"
        n = int(info.get("attempt") or 1)
        reason = info.get("reason") or errors.get(m) or "no reason recorded"
        parts.append(f"learner {m} {verb} {at} after {n} attempt{'' if n == 1 else 's'} ({reason})")
    retried = "" if retries is None else f" (diloco.learner_retries {retries})"
    return f"every learner ended before the budget was spent{retried}: " + "; ".join(parts)
