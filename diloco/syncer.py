"""The syncer's state machine: versioned global fragments, quorum, grace window, merge, ledger.

Pure bookkeeping with an explicit clock (``now`` in seconds is passed in): no threads, no I/O, so
every rule here is testable in milliseconds. The loop that drives it lives in ``diloco.syncer_loop``.

Per fragment p (Douillard et al., "Decoupled DiLoCo", arXiv 2604.21428, the syncer merge):
1. collect submissions, at most one pending per learner: per learner and fragment the submission
   with the later (attempt, local_step) wins, whatever order the exchange delivers them in. A
   submission in a quantised wire format (``diloco.wire``: bfloat16, int8, int4) carries the
   update Δ = θ_{m,p} − Θ_p at its base version; the syncer keeps the last ``max_staleness + 1``
   versions of each fragment (with such a ``wire`` configured) and rebuilds θ_{m,p} = Θ_base + Δ on
   receipt, before the checks below; with float32 the submission is θ_{m,p} itself;
2. merge once ≥ K distinct learners are pending (minimum quorum) and either the grace window
   (seconds after quorum) has passed or every live learner has submitted;
3. outer gradient per learner v_m = Θ_p − θ_{m,p}, anchored at the *current* global fragment, also
   for a late submission (the paper's rule). Anchoring late work at the version it started from
   instead would add its progress on top of a Θ that already moved the same way: with momentum
   and K < M that double counts and diverged in our runs; anchoring at Θ_p keeps a late
   submission an average of parameters;
4. merge the v_m with the configured rule (``mean``, ``token_weighted``, ``rda``);
5. outer Nesterov SGD step; if the merged outer gradient and the new fragment are finite float32,
   adopt them and bump the version (the caller publishes), else refuse the merge (below).
Each (learner, fragment, local step) is merged at most once. A learner whose process died resumes
from its last resume point (``diloco.learner``) and trains the steps since again; the syncer keeps,
per learner and fragment, the highest local step h whose work was merged (over all attempts). A
later attempt's submission at a local step ≤ h is dropped as "recomputed" (never merged), and of
one past h only the steps after h are new work: its counters cover the local steps (local_step −
steps, local_step] (they run from the learner's last receipt of the fragment or its resume, one
step at a time), so the first min(h − (local_step − steps), steps) of them re-did merged steps and
hold tokens · that / steps of its tokens (every step of a learner takes the same tokens). Those
tokens go to the ledger's ``recomputed`` column, not to merged: the work was done twice and
counted once. (The merge still weighs the submission by its counters: its parameters hold all
those steps.) Steps at or below h that a copy of the earlier attempt never brought in (progress
overwritten at a receipt, or steps never sent) count as recomputed too: h is a high-water mark.

Dropped, never merged, and counted in the token ledger as dropped with the reason: submissions
with no tokens ("empty", not queued and no quorum vote), older than one already seen from the same
learner ("out-of-order"), replaced by a newer one of another base or attempt ("superseded"), more
than ``max_staleness`` versions behind ("stale"), non-finite ("non-finite"), of the wrong shape
("wrong-tensors"), and every contributor to a refused merge ("bad-merge"). A refused merge (finite
but huge submissions can overflow float32) leaves Θ_p, its version and its outer optimizer state
exactly as they were and appends a "merge-refused" event.

The state is deterministic in the calls: the same ``receive``/``merge`` sequence (with the same
``now`` values) gives bit-identical state. ``state_dict``/``load_state_dict`` save and restore all of
it, which is what lets a syncer restart from a checkpoint plus a journal of the calls since
(``diloco.syncer_journal``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from diloco.exchange import Submission
from diloco.merge import MERGE_RULES, l2_norm, weights_for
from diloco.outer import make_outer_tx, outer_step
from diloco.wire import WireFormat


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
    # the learners' wire format (diloco.wire.WireFormat.spec): a quantised one makes the syncer keep
    # the last max_staleness + 1 versions of every fragment, the bases their updates are taken from
    wire: str = "float32"

    def __post_init__(self):
        if not 1 <= self.quorum <= self.num_learners:
            raise ValueError(f"quorum K={self.quorum} must be in [1, M={self.num_learners}]")
        if self.merge not in MERGE_RULES:
            raise ValueError(f"merge rule {self.merge!r} unknown; choose one of {sorted(MERGE_RULES)}")
        WireFormat.parse(self.wire)  # ValueError naming an unknown format

    @property
    def kept_bases(self) -> int:
        """Versions kept besides the current one per fragment, to decode submissions against:
        ``max_staleness`` for a quantised wire format, 0 for float32 (it sends θ, not Δ)."""
        return self.max_staleness if WireFormat.parse(self.wire).sends_delta else 0


@dataclass
class LedgerEntry:
    """Tokens per learner, summed over fragments (divide by P for per-model tokens).

    submitted = merged + recomputed + dropped + pending at every moment: a resend before receipt
    carries only its new tokens, a pending copy replaced by a newer one of the same base passes its
    tokens on, and a late copy whose work is inside a newer one is dropped with 0 tokens.
    ``recomputed``: tokens of local steps a restarted learner trained again after their work had
    been merged (each counted once, when first submitted again; see the module docstring).
    """

    submitted: int = 0
    merged: int = 0
    dropped: int = 0
    drop_reasons: dict[str, int] = field(default_factory=dict)
    recomputed: int = 0

    def drop(self, tokens: int, reason: str) -> None:
        self.dropped += tokens
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + tokens


def _finite_float32(tensors: dict[str, np.ndarray]) -> bool:
    """Every value finite once in float32 (a finite float64 beyond ±3.4e38 is not)."""
    with np.errstate(over="ignore"):
        return all(np.isfinite(np.asarray(a, dtype=np.float32)).all() for a in tensors.values())


def _decode(sub: Submission, shapes: dict[str, tuple[int, ...]]) -> tuple[WireFormat, dict[str, np.ndarray]] | None:
    """``(format, decoded tensors)`` of a submission's payload (float32: its arrays as sent; else
    the update Δ), or None if its format is unknown or the payload does not fit ``shapes``."""
    try:
        fmt = WireFormat.parse(sub.wire)
        return fmt, fmt.decode(sub.params, shapes)
    except ValueError:
        return None


def _rebuild(base: dict[str, np.ndarray], update: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """θ = Θ_base + Δ in float32 (an overflow gives ±inf, caught by the finiteness check)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return {k: base[k] + update[k] for k in base}


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
        # per fragment, version → Θ_p at that version: the current one and settings.kept_bases before it
        self.bases: list[dict[int, dict[str, np.ndarray]]] = [{0: g} for g in self.global_params]
        self.pending: list[dict[int, Submission]] = [{} for _ in self.fragments]
        # per fragment, learner → θ_{m,p} of its pending submission (decoded; float32: the sent arrays)
        self.pending_params: list[dict[int, dict[str, np.ndarray]]] = [{} for _ in self.fragments]
        self.quorum_at: list[float | None] = [None] * len(self.fragments)
        self.ledger = {m: LedgerEntry() for m in range(settings.num_learners)}
        # keyed (learner, fragment): submitted tokens of the pending copy; (attempt, local_step) of
        # the newest submission seen; tokens counted so far per (attempt, base_version)
        self._unmerged: dict[tuple[int, int], int] = {}
        self._newest: dict[tuple[int, int], tuple[int, int]] = {}
        self._counted: dict[tuple[int, int], dict[tuple[int, int], int]] = {}
        # keyed (learner, fragment): the highest local step whose work was merged, over all attempts
        self._merged_step: dict[tuple[int, int], int] = {}
        self.events: list[dict] = []
        self.num_merges = 0

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    # -- receiving ---------------------------------------------------------------------------
    def _fresh_tokens(self, sub: Submission, newest: bool) -> int:
        """Tokens in ``sub`` not counted yet, in whatever order the submissions arrive.

        A learner's counters run from its last receipt of the fragment, so the submissions of one
        attempt and base version are cumulative and together hold max(tokens) of them: a resend
        counts only the excess over the largest count seen for its (attempt, base_version), and a
        late older copy inside a newer one counts 0. Counts are remembered for bases within
        ``max_staleness + 1`` of the learner's newest one; a copy delayed past that is counted in full.
        """
        counted = self._counted.setdefault((sub.learner, sub.fragment), {})
        group = (sub.attempt, sub.base_version)
        before = counted.get(group, 0)
        counted[group] = max(before, sub.tokens)
        if newest:
            oldest = sub.base_version - self.settings.max_staleness - 1
            for g in [g for g in counted if g[1] < oldest]:
                del counted[g]
        return max(sub.tokens - before, 0)

    def _recomputed(self, sub: Submission) -> int:
        """Tokens of ``sub``'s counters spent on local steps at or below h, the highest one already
        merged from this learner and fragment: all of them if ``local_step`` ≤ h, else tokens · r /
        steps (rounded down) for the r of its steps (local_step − steps, local_step] that are ≤ h;
        0 if nothing of this learner and fragment was merged yet."""
        high = self._merged_step.get((sub.learner, sub.fragment))
        if high is None:
            return 0
        if sub.local_step <= high:
            return sub.tokens
        if sub.steps <= 0:
            return 0
        redone = min(max(high - (sub.local_step - sub.steps), 0), sub.steps)
        return sub.tokens * redone // sub.steps

    def _reject(self, sub: Submission, reason: str, now: float, tokens: int | None = None) -> None:
        tokens = sub.tokens if tokens is None else tokens
        if 0 <= sub.learner < self.settings.num_learners:
            self.ledger[sub.learner].drop(tokens, reason)
        self.events.append(
            {
                "event": "dropped",
                "learner": sub.learner,
                "fragment": sub.fragment,
                "reason": reason,
                "tokens": tokens,
                "base_version": sub.base_version,
                "t": now,
            }
        )

    def receive(self, sub: Submission, now: float) -> bool:
        """Validate and queue one submission (``now``: the syncer's clock, seconds).

        Order of checks, each a drop counted in the ledger and logged in ``events``: unknown learner
        or fragment; "empty" (``tokens`` ≤ 0: no progress, 0 tokens, not queued, no quorum vote;
        the learner never sends one); "out-of-order" ((attempt, local_step) not later than the
        newest already seen from this learner for this fragment, merged or not: dropped with its
        tokens not inside the newer one, i.e. 0 for the same attempt and base, all of them for an
        older base); "recomputed" (a later attempt's copy at a local step whose work was already
        merged: its new tokens go to the ledger's ``recomputed``, not to ``dropped``; of any other
        copy the tokens of re-trained merged steps go there too, see the module docstring); wrong
        tensors (an unknown wire format, or a payload that does not decode to the fragment's
        tensors); non-finite (the decoded payload); unknown or stale base version; for a quantised
        format, "stale" also when the base version is no longer kept (see
        ``SyncerSettings.kept_bases``) and "non-finite" when Θ_base + Δ overflows. A queued
        submission replaces the learner's pending copy: with the same (attempt, base) it carries
        that copy's tokens on, else the old copy is dropped as "superseded" (its work is lost).

        Returns True if queued, False if dropped. Raises nothing.
        """
        if not 0 <= sub.learner < self.settings.num_learners:
            self._reject(sub, "unknown-learner", now)
            return False
        if not 0 <= sub.fragment < self.num_fragments:
            self._reject(sub, "unknown-fragment", now)
            return False
        if sub.tokens <= 0:
            self._reject(sub, "empty", now, 0)
            return False
        p, key, order = sub.fragment, (sub.learner, sub.fragment), (sub.attempt, sub.local_step)
        newest = key not in self._newest or order > self._newest[key]
        before = self._counted.get(key, {}).get((sub.attempt, sub.base_version), 0)
        fresh = self._fresh_tokens(sub, newest)
        self.ledger[sub.learner].submitted += fresh
        if not newest:
            self._reject(sub, "out-of-order", now, fresh)
            return False
        self._newest[key] = order
        # the copies of one (attempt, base) are cumulative, their re-trained steps come first: the
        # tokens counted before this copy cover the first `before` of its re-trained ones
        redone = min(max(self._recomputed(sub) - before, 0), fresh)
        if redone:
            self.ledger[sub.learner].recomputed += redone
            fresh -= redone
        if sub.local_step <= self._merged_step.get(key, -1):
            self.events.append(
                {
                    "event": "dropped",
                    "learner": sub.learner,
                    "fragment": sub.fragment,
                    "reason": "recomputed",
                    "tokens": redone,
                    "base_version": sub.base_version,
                    "t": now,
                }
            )
            return False
        decoded = _decode(sub, {k: a.shape for k, a in self.global_params[p].items()})
        if decoded is None:
            self._reject(sub, "wrong-tensors", now, fresh)
            return False
        fmt, update = decoded
        if not all(np.isfinite(a).all() for a in update.values()):
            self._reject(sub, "non-finite", now, fresh)
            return False
        if sub.base_version > self.versions[p] or sub.base_version < 0:
            self._reject(sub, "unknown-version", now, fresh)
            return False
        if self.versions[p] - sub.base_version > self.settings.max_staleness or (
            fmt.sends_delta and sub.base_version not in self.bases[p]
        ):
            self._reject(sub, "stale", now, fresh)
            return False
        theta = update
        if fmt.sends_delta:
            theta = _rebuild(self.bases[p][sub.base_version], update)
            if not all(np.isfinite(a).all() for a in theta.values()):
                self._reject(sub, "non-finite", now, fresh)
                return False
        old = self.pending[p].get(sub.learner)
        carried = 0
        if old is not None and (old.attempt, old.base_version) == (sub.attempt, sub.base_version):
            carried = self._unmerged.get(key, 0)  # the newer copy contains the older one's work
        elif old is not None:
            self._reject(old, "superseded", now, self._unmerged.get(key, 0))  # its work is lost
        self._unmerged[key] = carried + fresh
        self.pending[p][sub.learner] = sub
        self.pending_params[p][sub.learner] = theta
        if self.quorum_at[p] is None and len(self.pending[p]) >= self.settings.quorum:
            self.quorum_at[p] = now
        return True

    # -- merging -----------------------------------------------------------------------------
    def quorum(self, down: set[int] = frozenset()) -> int:
        """The quorum in force: K, or the number of learners not ``down`` when fewer remain (at
        least 1). ``down``: learners that reported and have since ended or gone silent (the loop's
        view from heartbeats, ``diloco.heartbeat_timeout_s``); a learner that has not reported yet
        counts as alive. Leaving the dead out of the quorum keeps merges going without them (zero
        global downtime): K = M degrades to the learners still alive instead of stalling."""
        return max(1, min(self.settings.quorum, self.settings.num_learners - len(down)))

    def ready(
        self, p: int, now: float, live: set[int], grace_s: float | None = None, down: set[int] = frozenset()
    ) -> bool:
        """Quorum reached and (grace window over, or every live learner has submitted).
        ``live``: the learners the loop sees running; ``down``: those it knows ended or silent (the
        quorum is then :meth:`quorum`, reached at ``now`` once that many have submitted).
        ``grace_s``: this round's window (seconds; default ``settings.grace_s``, the fixed one)."""
        if self.quorum_at[p] is None:
            if not self.pending[p] or len(self.pending[p]) < self.quorum(down):
                return False
            self.quorum_at[p] = now  # reached because learners died or ended, not by a submission
        if now - self.quorum_at[p] >= (self.settings.grace_s if grace_s is None else grace_s):
            return True
        return live <= set(self.pending[p])

    def merge(self, p: int, now: float) -> dict | None:
        """Merge every pending submission of fragment ``p`` into Θ_p (one outer step), if sound.

        The outer gradients v_m = Θ_p − θ_{m,p} are taken in float64. The merge is adopted only if
        the merged outer gradient and the new Θ_p are all finite float32 values; otherwise it is
        refused: Θ_p, its version and its outer optimizer state stay bit-identical, the pending
        submissions are removed and dropped in the ledger as "bad-merge", and an event
        {"event": "merge-refused", "fragment", "reason", "contributors", "tokens" (their counters),
        "t" (``now``, seconds)} is appended to ``events``.

        Returns the merge record (fragment, version, contributors, weights, tokens, steps, stale,
        local_steps, attempts, quorum_at_s, merged_at_s, bytes_in/out, fragment_bytes, outer_grad_norm), or
        None if the merge was refused. Raises ``ValueError`` if nothing is pending.
        """
        subs = [self.pending[p][m] for m in sorted(self.pending[p])]
        if not subs:
            raise ValueError(f"fragment {p}: nothing to merge")
        tokens = [s.tokens for s in subs]
        steps = [max(s.steps, 1) for s in subs]  # every queued submission has tokens > 0
        anchor = self.global_params[p]
        anchor64 = {k: a.astype(np.float64) for k, a in anchor.items()}
        thetas = [self.pending_params[p][s.learner] for s in subs]
        deltas = [{k: anchor64[k] - theta[k] for k in anchor} for theta in thetas]
        outer_grad = MERGE_RULES[self.settings.merge](deltas, tokens, steps, self.embedding_names)
        reason = None
        if not _finite_float32(outer_grad):
            reason = "non-finite outer gradient"
        else:
            new_params, new_state = outer_step(self.tx, anchor, self.opt_states[p], outer_grad)
            if not _finite_float32(new_params):
                reason = "non-finite fragment after the outer step"
        quorum_at = self.quorum_at[p]
        self.pending[p], self.pending_params[p], self.quorum_at[p] = {}, {}, None
        if reason is not None:
            for s in subs:
                self._reject(s, "bad-merge", now, self._unmerged.pop((s.learner, p), 0))
            self.events.append(
                {
                    "event": "merge-refused",
                    "fragment": p,
                    "reason": reason,
                    "contributors": [s.learner for s in subs],
                    "tokens": tokens,
                    "t": now,
                }
            )
            return None
        self.global_params[p], self.opt_states[p] = new_params, new_state
        self.versions[p] += 1
        self._keep_base(p)
        for s in subs:
            self.ledger[s.learner].merged += self._unmerged.pop((s.learner, p), 0)
            high = self._merged_step.get((s.learner, p), s.local_step)
            self._merged_step[(s.learner, p)] = max(s.local_step, high)
        self.num_merges += 1
        fragment_bytes = int(sum(a.nbytes for a in new_params.values()))
        return {
            "fragment": p,
            "version": self.versions[p],
            "contributors": [s.learner for s in subs],
            "weights": [round(float(w), 6) for w in weights_for(self.settings.merge, tokens, steps)],
            "tokens": tokens,
            "steps": [s.steps for s in subs],
            "stale": [self.versions[p] - 1 - s.base_version for s in subs],
            "local_steps": [s.local_step for s in subs],
            "attempts": [s.attempt for s in subs],
            "quorum_at_s": quorum_at,
            "merged_at_s": now,
            "bytes_in": int(sum(s.nbytes for s in subs)),  # payloads as sent (codes and scales)
            "fragment_bytes": fragment_bytes,
            # published once, pulled by every learner: the syncer's send fan-out
            "bytes_out": fragment_bytes * self.settings.num_learners,
            "outer_grad_norm": l2_norm(np.array([l2_norm(g) for g in outer_grad.values()])),
        }

    def _keep_base(self, p: int) -> None:
        """Remember Θ_p at its current version and forget versions older than ``kept_bases`` before it."""
        v = self.versions[p]
        self.bases[p][v] = self.global_params[p]
        for old in [u for u in self.bases[p] if u < v - self.settings.kept_bases]:
            del self.bases[p][old]

    def _merge_all(self, fragments, now: float) -> list[dict]:
        records = [self.merge(p, now) for p in fragments]
        return [r for r in records if r is not None]

    def poll(self, now: float, live: set[int], grace_s: dict[int, float] | None = None) -> list[dict]:
        """Merge every fragment that is ready at ``now`` (seconds; ``live``: learner ids;
        ``grace_s``: per fragment, the round's window when not the fixed one).

        Returns the records of the adopted merges, in fragment order; refused ones are left out
        (their "merge-refused" events are in ``events``)."""
        grace_s = grace_s or {}
        return self._merge_all([p for p in range(self.num_fragments) if self.ready(p, now, live, grace_s.get(p))], now)

    def flush(self, now: float) -> list[dict]:
        """Merge everything still pending, quorum or not (used once all learners have stopped).

        Returns the records of the adopted merges only, as :meth:`poll`."""
        return self._merge_all([p for p in range(self.num_fragments) if self.pending[p]], now)

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

    # -- saving and restoring -----------------------------------------------------------------
    def state_dict(self) -> tuple[dict, dict]:
        """Everything needed to continue bit-identically, as ``(arrays, meta)``.

        ``arrays`` (for Orbax): ``{"global": {"fragment_<p:03d>": {"<i:04d>": Θ_p's i-th tensor in
        ``fragments[p]`` order, float32, its shape}}, "outer": {"fragment_<p:03d>": {"<i:04d>": the
        i-th leaf of fragment p's outer optimizer state (``jax.tree.leaves``; momentum buffers,
        float32, Θ_p's shapes; none without momentum)}}}``, and with a quantised wire format
        (``settings.kept_bases`` = S > 0) ``"bases": {"fragment_<p:03d>": {"back_<k:02d>": {"<i:04d>":
        Θ_p at version (current − k), k = 1..S, float32; zeros where that version is below 0}}}``: the
        bases pending and later submissions are decoded against (the structure does not depend on
        the versions, so a fresh syncer's ``state_dict`` describes any saved one).
        ``meta`` (JSON values only): ``fragments`` and ``settings`` (checked on load), ``versions``,
        ``quorum_at`` (seconds on the syncer's clock, or null), ``pending`` (per fragment, each
        pending submission's counters and its exchange object name ``key``, not its arrays: they
        stay in the exchange), ``ledger`` (tokens per learner), ``unmerged``/``newest``/``counted``
        (the token-counting memory, tuple keys written as ``"m,p"`` and ``"attempt,base"``),
        ``merged_steps`` (``"m,p"`` → the highest local step merged),
        ``events`` and ``num_merges``. Arrays are copies: later merges do not change them.

        Raises ``ValueError`` if a pending submission has no object name (``Submission.key`` is
        set by durable exchanges only: the in-process exchange's syncer is not restartable).
        """
        arrays = {
            "global": {
                f"fragment_{p:03d}": {f"{i:04d}": np.array(g[k], copy=True) for i, k in enumerate(frag)}
                for p, (frag, g) in enumerate(zip(self.fragments, self.global_params))
            },
            "outer": {
                f"fragment_{p:03d}": {f"{i:04d}": np.array(x, copy=True) for i, x in enumerate(jax.tree.leaves(st))}
                for p, st in enumerate(self.opt_states)
            },
        }
        if self.settings.kept_bases:
            arrays["bases"] = {
                f"fragment_{p:03d}": {
                    f"back_{k:02d}": {
                        f"{i:04d}": (
                            np.array(bases[v - k][name], copy=True) if v - k in bases else np.zeros_like(g[name])
                        )
                        for i, name in enumerate(frag)
                    }
                    for k in range(1, self.settings.kept_bases + 1)
                }
                for p, (frag, g, bases, v) in enumerate(
                    zip(self.fragments, self.global_params, self.bases, self.versions)
                )
            }
        pending = []
        for p, frag in enumerate(self.pending):
            row = []
            for s in frag.values():
                if s.key is None:
                    raise ValueError(
                        f"fragment {p}: learner {s.learner}'s pending submission has no object name "
                        "(Submission.key); only submissions drained from a durable exchange can be saved"
                    )
                row.append({**{f: getattr(s, f) for f in _SAVED_FIELDS}, "key": s.key})
            pending.append(row)
        meta = {
            "format": STATE_FORMAT,
            "fragments": self.fragments,
            "settings": asdict(self.settings),
            "versions": list(self.versions),
            "quorum_at": list(self.quorum_at),
            "pending": pending,
            "ledger": {
                str(m): {
                    "submitted": e.submitted,
                    "merged": e.merged,
                    "dropped": e.dropped,
                    "drop_reasons": dict(e.drop_reasons),
                    "recomputed": e.recomputed,
                }
                for m, e in self.ledger.items()
            },
            "unmerged": {_pair(k): v for k, v in self._unmerged.items()},
            "newest": {_pair(k): list(v) for k, v in self._newest.items()},
            "counted": {_pair(k): {_pair(g): n for g, n in c.items()} for k, c in self._counted.items()},
            "merged_steps": {_pair(k): v for k, v in self._merged_step.items()},
            "events": [dict(e) for e in self.events],
            "num_merges": self.num_merges,
        }
        return arrays, json.loads(json.dumps(meta))  # JSON values only, detached from live state

    def load_state_dict(self, arrays: dict, meta: dict, fetch: Callable[[str], Submission]) -> None:
        """Replace this syncer's state with one saved by :meth:`state_dict`.

        ``arrays``/``meta`` as :meth:`state_dict` returns them (arrays may be numpy or jax arrays);
        ``fetch(key)`` returns the submission stored under an exchange object name (its params are
        the pending copy's payload, decoded again here against the restored bases). The syncer must
        have been built with the same fragments and settings. Afterwards the same
        ``receive``/``merge`` calls give bit-identical results to the syncer that was saved.

        Raises ``ValueError`` if the fragments, settings or format differ, a fetched submission's
        counters or wire format differ from the saved ones (another object under that name) or its
        payload no longer decodes against its base; whatever ``fetch`` raises for a missing object
        (the exchange: ``FileNotFoundError``).
        """
        if meta.get("format") not in (1, STATE_FORMAT):
            raise ValueError(f"syncer state format {meta.get('format')} is not 1 or {STATE_FORMAT}")
        if meta["fragments"] != self.fragments:
            raise ValueError(
                "the saved syncer state has other fragments than this syncer (another model or diloco.fragments)"
            )
        if {"wire": "float32", **meta["settings"]} != json.loads(json.dumps(asdict(self.settings))):
            raise ValueError(
                f"the saved syncer state has other settings ({meta['settings']}) than this syncer "
                f"({asdict(self.settings)}): restart with the run's config"
            )
        global_params, opt_states = [], []
        for p, frag in enumerate(self.fragments):
            saved = arrays["global"][f"fragment_{p:03d}"]
            global_params.append({k: np.asarray(saved[f"{i:04d}"], dtype=np.float32) for i, k in enumerate(frag)})
            leaves = arrays["outer"].get(f"fragment_{p:03d}") or {}
            treedef = jax.tree.structure(self.tx.init(global_params[p]))
            opt_states.append(jax.tree.unflatten(treedef, [jnp.asarray(leaves[k]) for k in sorted(leaves)]))
        versions = [int(v) for v in meta["versions"]]
        bases: list[dict[int, dict[str, np.ndarray]]] = []
        for p, frag in enumerate(self.fragments):
            held = {versions[p]: global_params[p]}
            for k in range(1, self.settings.kept_bases + 1):
                if versions[p] - k >= 0:
                    saved = arrays["bases"][f"fragment_{p:03d}"][f"back_{k:02d}"]
                    held[versions[p] - k] = {
                        name: np.asarray(saved[f"{i:04d}"], dtype=np.float32) for i, name in enumerate(frag)
                    }
            bases.append(held)
        pending: list[dict[int, Submission]] = []
        pending_params: list[dict[int, dict[str, np.ndarray]]] = []
        for p, row in enumerate(meta["pending"]):
            frag, thetas = {}, {}
            for saved in row:
                sub = fetch(saved["key"])
                got = {f: getattr(sub, f) for f in _SAVED_FIELDS if f != "sent_at"}
                want = {
                    f: saved.get(f, "float32") if f == "wire" else saved[f] for f in _SAVED_FIELDS if f != "sent_at"
                }
                if got != want:
                    raise ValueError(f"object {saved['key']} holds {got}, the saved syncer state expects {want}")
                decoded = _decode(sub, {k: a.shape for k, a in global_params[p].items()})
                if decoded is None or (decoded[0].sends_delta and sub.base_version not in bases[p]):
                    raise ValueError(
                        f"object {saved['key']}: its {sub.wire} payload does not decode against "
                        f"fragment {p} v{sub.base_version} of the saved syncer state"
                    )
                fmt, update = decoded
                sub.key = saved["key"]
                frag[int(saved["learner"])] = sub
                thetas[int(saved["learner"])] = (
                    _rebuild(bases[p][sub.base_version], update) if fmt.sends_delta else update
                )
            pending.append(frag)
            pending_params.append(thetas)
        self.global_params, self.opt_states = global_params, opt_states
        self.bases, self.pending_params = bases, pending_params
        self.versions = versions
        self.quorum_at = [None if t is None else float(t) for t in meta["quorum_at"]]
        self.pending = pending
        self.ledger = {
            int(m): LedgerEntry(
                int(e["submitted"]),
                int(e["merged"]),
                int(e["dropped"]),
                {k: int(n) for k, n in e["drop_reasons"].items()},
                int(e.get("recomputed", 0)),
            )
            for m, e in meta["ledger"].items()
        }
        self._unmerged = {_unpair(k): int(v) for k, v in meta["unmerged"].items()}
        self._newest = {_unpair(k): tuple(int(x) for x in v) for k, v in meta["newest"].items()}
        self._counted = {_unpair(k): {_unpair(g): int(n) for g, n in c.items()} for k, c in meta["counted"].items()}
        self._merged_step = {_unpair(k): int(v) for k, v in meta.get("merged_steps", {}).items()}
        self.events = [dict(e) for e in meta["events"]]
        self.num_merges = int(meta["num_merges"])


# 2: the ledger's ``recomputed`` and ``merged_steps``. A format-1 state (saved before them) still loads, with
# nothing recomputed and no merged steps known: a run restarted across the upgrade keeps going, and only steps
# re-trained after a learner crash that predates the restart can be merged twice, as before format 2.
STATE_FORMAT = 2
_SAVED_FIELDS = ("learner", "fragment", "tokens", "steps", "base_version", "local_step", "attempt", "sent_at", "wire")


def _pair(key: tuple[int, int]) -> str:
    return f"{key[0]},{key[1]}"


def _unpair(text: str) -> tuple[int, int]:
    a, b = text.split(",")
    return int(a), int(b)
