"""The syncer's state machine: versioned global fragments, quorum, grace window, merge, ledger.

Pure bookkeeping with an explicit clock (``now`` in seconds is passed in): no threads, no I/O, so
every rule here is testable in milliseconds. The loop that drives it lives in ``diloco.runtime``.

Per fragment p (Douillard et al., "Decoupled DiLoCo", arXiv 2604.21428, the syncer merge):
1. collect submissions, at most one pending per learner (a newer one replaces the older);
2. merge once ≥ K distinct learners are pending (minimum quorum) and either the grace window
   (seconds after quorum) has passed or every live learner has submitted;
3. outer gradient per learner v_m = Θ_p − θ_{m,p}, anchored at the *current* global fragment, also
   for a late submission (the paper's rule). Anchoring late work at the version it started from
   instead would add its progress on top of a Θ that already moved the same way: with momentum
   and K < M that double counts and diverged in our runs; anchoring at Θ_p keeps a late
   submission an average of parameters;
4. merge the v_m with the configured rule (``mean``, ``token_weighted``, ``rda``);
5. outer Nesterov SGD step, bump the version; the caller publishes.
Submissions more than ``max_staleness`` versions behind, non-finite, or of the wrong shape are
never merged; they are counted in the token ledger as dropped, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from diloco.exchange import Submission
from diloco.merge import MERGE_RULES, weights_for
from diloco.outer import make_outer_tx, outer_step


@dataclass(frozen=True)
class SyncerSettings:
    num_learners: int
    quorum: int = 1
    grace_s: float = 0.0
    merge: str = "token_weighted"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    max_staleness: int = 1

    def __post_init__(self):
        if not 1 <= self.quorum <= self.num_learners:
            raise ValueError(f"quorum K={self.quorum} must be in [1, M={self.num_learners}]")
        if self.merge not in MERGE_RULES:
            raise ValueError(f"merge rule {self.merge!r} unknown; choose one of {sorted(MERGE_RULES)}")


@dataclass
class LedgerEntry:
    """Tokens per learner, summed over fragments (divide by P for per-model tokens).

    submitted = merged + dropped + pending at every moment: a resend before receipt carries only
    its new tokens, and a pending copy replaced by a newer one of the same base passes its tokens on.
    """

    submitted: int = 0
    merged: int = 0
    dropped: int = 0
    drop_reasons: dict[str, int] = field(default_factory=dict)

    def drop(self, tokens: int, reason: str) -> None:
        self.dropped += tokens
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + tokens


class Syncer:
    """Holds Θ (per fragment), outer optimizer state, versions, pending submissions and the ledger.

    Args:
        params: the initial global parameters, tensor name → float32 array.
        fragments: P lists of tensor names (``diloco.fragments.balanced_fragments``).
        settings: quorum, grace window, merge rule and outer optimizer.
        embedding_names: tensors merged by plain weighted average under RDA.
    """

    def __init__(self, params, fragments, settings: SyncerSettings, embedding_names=()):
        self.settings = settings
        self.fragments = [list(f) for f in fragments]
        self.embedding_names = set(embedding_names)
        self.tx = make_outer_tx(settings.outer_lr, settings.outer_momentum, settings.outer_nesterov)
        self.global_params = [
            {k: np.array(params[k], dtype=np.float32, copy=True) for k in frag} for frag in self.fragments
        ]
        self.versions = [0] * len(self.fragments)
        self.opt_states = [self.tx.init(g) for g in self.global_params]
        self.pending: list[dict[int, Submission]] = [{} for _ in self.fragments]
        self.quorum_at: list[float | None] = [None] * len(self.fragments)
        self.ledger = {m: LedgerEntry() for m in range(settings.num_learners)}
        self._unmerged: dict[tuple[int, int], int] = {}  # submitted tokens of the pending copy
        self._seen: dict[tuple[int, int], tuple[int, int]] = {}  # received (base, tokens)
        self.events: list[dict] = []
        self.num_merges = 0

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    # -- receiving ---------------------------------------------------------------------------
    def _fresh_tokens(self, sub: Submission) -> int:
        """Tokens in ``sub`` not already in an earlier submission of the same learner, fragment and
        base version (counters run from the learner's last receipt, so resends are cumulative)."""
        key = (sub.learner, sub.fragment)
        prev_base, prev_tokens = self._seen.get(key, (None, 0))
        self._seen[key] = (sub.base_version, sub.tokens)
        return max(sub.tokens - prev_tokens, 0) if prev_base == sub.base_version else sub.tokens

    def _reject(self, sub: Submission, reason: str, now: float, tokens: int | None = None) -> None:
        tokens = sub.tokens if tokens is None else tokens
        if 0 <= sub.learner < self.settings.num_learners:
            self.ledger[sub.learner].drop(tokens, reason)
        self.events.append(
            {"event": "dropped", "learner": sub.learner, "fragment": sub.fragment, "reason": reason,
             "tokens": tokens, "base_version": sub.base_version, "t": now}
        )

    def receive(self, sub: Submission, now: float) -> bool:
        """Validate and queue one submission. Returns False if it was dropped (see ``events``)."""
        if not 0 <= sub.learner < self.settings.num_learners:
            self._reject(sub, "unknown-learner", now)
            return False
        if not 0 <= sub.fragment < self.num_fragments:
            self._reject(sub, "unknown-fragment", now)
            return False
        p = sub.fragment
        fresh = self._fresh_tokens(sub)
        self.ledger[sub.learner].submitted += fresh
        ref = self.global_params[p]
        if set(sub.params) != set(ref) or any(sub.params[k].shape != ref[k].shape for k in ref):
            self._reject(sub, "wrong-tensors", now, fresh)
            return False
        if not all(np.isfinite(a).all() for a in sub.params.values()):
            self._reject(sub, "non-finite", now, fresh)
            return False
        if sub.base_version > self.versions[p] or sub.base_version < 0:
            self._reject(sub, "unknown-version", now, fresh)
            return False
        if self.versions[p] - sub.base_version > self.settings.max_staleness:
            self._reject(sub, "stale", now, fresh)
            return False
        key = (sub.learner, p)
        old = self.pending[p].get(sub.learner)
        carried = 0
        if old is not None and old.base_version == sub.base_version:
            carried = self._unmerged.get(key, 0)  # the newer copy contains the older one's work
        elif old is not None:
            self._reject(old, "superseded", now, self._unmerged.get(key, 0))  # its work is lost
        self._unmerged[key] = carried + fresh
        self.pending[p][sub.learner] = sub
        if self.quorum_at[p] is None and len(self.pending[p]) >= self.settings.quorum:
            self.quorum_at[p] = now
        return True

    # -- merging -----------------------------------------------------------------------------
    def ready(self, p: int, now: float, live: set[int]) -> bool:
        """Quorum reached and (grace window over, or every live learner has submitted)."""
        if self.quorum_at[p] is None:
            return False
        if now - self.quorum_at[p] >= self.settings.grace_s:
            return True
        return live <= set(self.pending[p])

    def merge(self, p: int, now: float) -> dict:
        """Merge every pending submission of fragment ``p`` into Θ_p (one outer step).

        Returns the merge record (fragment, version, contributors, weights, tokens, steps, stale,
        bytes_in, quorum_at, merged_at). Raises ``ValueError`` if nothing is pending.
        """
        subs = [self.pending[p][m] for m in sorted(self.pending[p])]
        if not subs:
            raise ValueError(f"fragment {p}: nothing to merge")
        tokens = [s.tokens for s in subs]
        steps = [max(s.steps, 1) if s.tokens > 0 else s.steps for s in subs]
        deltas = []
        anchor = self.global_params[p]
        for s in subs:
            deltas.append({k: anchor[k] - s.params[k] for k in anchor})
        rule = MERGE_RULES[self.settings.merge]
        outer_grad = rule(deltas, tokens, steps, self.embedding_names)
        new_params, self.opt_states[p] = outer_step(self.tx, self.global_params[p], self.opt_states[p], outer_grad)
        self.global_params[p] = new_params
        self.versions[p] += 1
        for s in subs:
            self.ledger[s.learner].merged += self._unmerged.pop((s.learner, p), 0)
        record = {
            "fragment": p,
            "version": self.versions[p],
            "contributors": [s.learner for s in subs],
            "weights": [round(float(w), 6) for w in weights_for(self.settings.merge, tokens, steps)],
            "tokens": tokens,
            "steps": [s.steps for s in subs],
            "stale": [self.versions[p] - 1 - s.base_version for s in subs],
            "local_steps": [s.local_step for s in subs],
            "quorum_at_s": self.quorum_at[p],
            "merged_at_s": now,
            "bytes_in": int(sum(s.nbytes for s in subs)),
            "fragment_bytes": int(sum(a.nbytes for a in new_params.values())),
            # published once, pulled by every learner: the syncer's send fan-out
            "bytes_out": int(sum(a.nbytes for a in new_params.values())) * self.settings.num_learners,
            "outer_grad_norm": float(np.sqrt(sum(float(np.sum(g * g)) for g in outer_grad.values()))),
        }
        self.pending[p] = {}
        self.quorum_at[p] = None
        self.num_merges += 1
        return record

    def poll(self, now: float, live: set[int]) -> list[dict]:
        """Merge every fragment that is ready now; returns their records."""
        return [self.merge(p, now) for p in range(self.num_fragments) if self.ready(p, now, live)]

    def flush(self, now: float) -> list[dict]:
        """Merge everything still pending, quorum or not (used once all learners have stopped)."""
        return [self.merge(p, now) for p in range(self.num_fragments) if self.pending[p]]

    def pending_tokens(self) -> dict[int, int]:
        out = {m: 0 for m in self.ledger}
        for p, frag in enumerate(self.pending):
            for m in frag:
                out[m] += self._unmerged.get((m, p), 0)
        return out

    # -- state -------------------------------------------------------------------------------
    def params(self) -> dict[str, np.ndarray]:
        """All global parameters as one flat mapping."""
        out = {}
        for g in self.global_params:
            out.update(g)
        return out
