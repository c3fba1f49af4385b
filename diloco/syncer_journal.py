"""A syncer that survives: a write-ahead journal in the exchange plus Orbax checkpoints of its state.

Used with the durable exchange (``diloco.exchange.fsspec``); the in-process exchange dies with its
syncer, so there is nothing to recover there. The pieces:

* **The syncer is a deterministic state machine** (``diloco.syncer.Syncer``): the same sequence of
  ``receive(sub, now)`` and ``merge(p, now)`` calls gives bit-identical state (numpy and optax on
  the CPU, no randomness, no clock of its own).
* **Journal, written ahead of every publish.** Before the syncer loop publishes a merge (or after a
  refused one, which changes the ledger) it writes ``journal/<seq:010d>-g<generation:06d>.json``
  through :meth:`FsspecExchange.write_journal` (fenced, atomic): ``seq`` (1, 2, …), ``generation``,
  ``received`` (``[object name, now]`` for every inbox object received since the previous entry,
  in order; ``now`` in seconds on the run's clock), ``merge`` (the fragment p merged; null for an
  entry that only records receipts), ``t`` (the merge's ``now``, seconds), ``version`` (the version
  the merge produced; null if refused or no merge), ``sha256`` (``tensors_digest`` of Θ_p after
  the merge: the published object's checksum) and ``loop`` (the loop's own state, e.g. the next
  evaluation threshold in tokens). One entry per merge, also in the final flush.
* **Inbox objects outlive their merge.** A received object is deleted only once two checkpoints
  cover it (see below); pending submissions are saved by object name, not by value.
* **Checkpoints** (a :class:`SyncerStateStore`, Orbax in ``training.checkpoint``) every
  ``checkpoint_every_s`` seconds and at the end: ``Syncer.state_dict()`` plus the journal seq it
  stands at, the generation, the received-and-not-yet-deleted object names (with the seq of the
  entry that recorded them) and the loop state. Before a checkpoint the receipts not yet journaled
  are written as a receipt-only entry, so every checkpoint sits exactly at a journal entry and the
  journal alone records every receipt. Step label: ``generation × 10⁹ + seq``.
* **Garbage collection.** The store keeps the newest two checkpoints. After a checkpoint is
  durable, everything the *older* kept checkpoint covers is deleted: journal entries with seq ≤ its
  seq and inbox objects received at or before it that it does not hold as pending. Either kept
  checkpoint can therefore be replayed from (a damaged newest one falls back to the older one), and
  before the second checkpoint nothing is deleted (a restart with no usable checkpoint replays the
  whole journal from Θ₀, version 0 in the exchange).

**Restart** (:meth:`SyncerJournal.recover`, by a syncer that has just taken office, so a stale
syncer's writes are refused from now on): read the journal and keep its valid chain (below); load
the newest intact checkpoint consistent with it, or start from Θ₀; re-read its pending submissions
from the inbox by name; replay every entry after its seq (receive the named objects at their
recorded times, merge exactly as recorded, check the version and sha256, publish only where the
exchange's published version is behind: the crash between journal and publish); then the loop goes
on, its drain skipping every object already received.

**Why no merge is lost or repeated.** A merge becomes visible only by its publish, and its journal
entry is durable before that publish. Crash before the entry: nothing of the merge (nor of the
receipts since the previous entry) was visible; the new syncer receives those objects again from
the inbox (they are not deleted yet) and merges them later, once. Crash between entry and publish:
replay redoes the merge bit-identically (same inputs, same order, same times), sees the exchange
one version behind and publishes it, once. Crash after the publish: replay redoes the merge in
memory and sees the exchange already at that version, so it does not publish again. Checkpoints
only shorten the replay: a checkpoint at seq s equals the state after replaying entries 1..s.

**Determinism is checked, not assumed.** Replay reproduces the outer step only on the same
software and the same kind of CPU (a different XLA build may round a float32 operation differently);
the sha256 in every entry turns any difference into :class:`JournalMismatchError` instead of a
silently different Θ.

**The valid chain (fencing).** Every entry carries the writer's generation. Walking seq upwards,
the entry of a seq is the one of the highest generation; the chain stops at a gap or at an entry
whose generation is below one already seen (a stale syncer slipped it in after its successor took
office, in the window between the office check and the write). A checkpoint is used only if the
chain holds its seq's entry from its generation (or that entry was garbage-collected just before
the chain starts). Entries beyond the chain are deleted by the recovering syncer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from diloco.exchange.fsspec import FsspecExchange, tensors_digest
from diloco.syncer import Syncer

logger = logging.getLogger(__name__)

FORMAT = 1
STEP_STRIDE = 10**9  # checkpoint step label = generation × STEP_STRIDE + seq


class JournalMismatchError(RuntimeError):
    """Replaying the journal did not reproduce what it records (version or sha256 of a merge), the
    journal has a gap, or the exchange publishes a version the journal does not explain."""


class SyncerStateStore(Protocol):
    """Where syncer checkpoints live (``training.checkpoint.OrbaxSyncerStore``)."""

    def steps(self) -> list[int]:
        """Complete steps, oldest first."""
        ...

    def save(self, step: int, arrays: dict, meta: dict) -> None:
        """Write step ``step`` durably (arrays: a pytree of numpy arrays; meta: JSON values)."""
        ...

    def load(self, step: int, like: dict) -> tuple[dict, dict]:
        """``(arrays, meta)`` of ``step``, arrays restored with the structure of ``like``; raises if
        the step is damaged or does not match."""
        ...

    def delete(self, step: int) -> None: ...


def journal_seq(name: str) -> int:
    """The seq of a journal object name ``<seq:010d>-g<generation:06d>.json``."""
    return int(name.split("-", 1)[0])


def journal_chain(entries: list[tuple[str, dict]]) -> tuple[list[dict], list[str]]:
    """The valid chain of journal entries (see the module docstring) and the names of the others.

    ``entries``: ``(object name, entry)`` as :meth:`FsspecExchange.journal` returns them. Returns
    ``(chain, outside)``: the chain's entries by ascending seq (contiguous), and the object names
    of every entry not in it (superseded by a higher generation, or beyond the chain's end)."""
    by_seq: dict[int, list[tuple[str, dict]]] = {}
    for name, entry in entries:
        by_seq.setdefault(int(entry["seq"]), []).append((name, entry))
    chain: list[dict] = []
    outside: list[str] = []
    floor, expected = 0, None
    seqs = sorted(by_seq)
    for i, seq in enumerate(seqs):
        cands = sorted(by_seq[seq], key=lambda ne: int(ne[1]["generation"]))
        best = cands[-1][1]
        if (expected is not None and seq != expected) or int(best["generation"]) < floor:
            outside += [n for s in seqs[i:] for n, _ in by_seq[s]]
            break
        outside += [n for n, _ in cands[:-1]]
        chain.append(best)
        floor, expected = int(best["generation"]), seq + 1
    return chain, outside


def _pending_names(syncer: Syncer) -> set[str]:
    return {s.key for frag in syncer.pending for s in frag.values() if s.key is not None}


class SyncerJournal:
    """The durability of one syncer in office: journal entries, checkpoints, recovery, GC.

    Args:
        exchange: the syncer's own handle on the fsspec exchange, in office (``take_office``).
        store: the checkpoint store (keeps the newest two steps).
        checkpoint_every_s: seconds between checkpoints (0: only :meth:`finish` checkpoints).
        clock: monotonic seconds (for the cadence only).

    The loop calls :meth:`recover` once before its first drain, :meth:`note_received` for every
    submission it hands to ``Syncer.receive``, :meth:`note_merge` after every ``Syncer.merge`` and
    before its publish, :meth:`maybe_checkpoint` once a round and :meth:`finish` at the end.
    Every write is fenced: :class:`~diloco.exchange.fsspec.StaleSyncerError` once a newer syncer
    has taken office.
    """

    def __init__(
        self,
        exchange: FsspecExchange,
        store: SyncerStateStore,
        checkpoint_every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.exchange = exchange
        self.store = store
        self.checkpoint_every_s = float(checkpoint_every_s)
        self.clock = clock
        self.seq = 0  # the last journal entry written or replayed
        self._buffer: list[list] = []  # [object name, now] received since the last entry
        self.received: dict[str, int | None] = {}  # object → seq of the entry recording it (None: not yet)
        self._kept: list[tuple[int, int, set[str]]] = []  # (step, seq, pending names), oldest first
        self._last_checkpoint_at = clock()
        self._last_checkpoint_seq: int | None = None
        self.recovery: dict | None = None  # what recover() did (for the run's event log)
        self._last_record: dict | None = None  # the record of the merge _replay just redid

    # -- restart ----------------------------------------------------------------------------------
    def recover(self, syncer: Syncer, loop: dict, on_merge: Callable[[dict], None]) -> dict:
        """Bring ``syncer`` (freshly built from Θ₀) and ``loop`` (the loop's state, updated in
        place) to where the previous syncer's journal ends, publishing what it journaled but did
        not publish; ``on_merge`` gets every replayed adopted merge's record with ``"replayed":
        True``. A run with no journal and no checkpoint is left untouched.

        Returns (and keeps as ``recovery``) a summary: ``generation``, ``checkpoint_step`` and
        ``checkpoint_seq`` (None: started from Θ₀), ``replayed`` (entries), ``republished``
        (merges published now), ``skipped_checkpoints`` (damaged or inconsistent steps, deleted)
        and ``recover_s`` (seconds). Raises :class:`JournalMismatchError` if the replay does not
        reproduce the journal, ``FileNotFoundError`` if an object it names is gone from the inbox,
        :class:`~diloco.exchange.fsspec.StaleSyncerError` if a newer syncer took office.
        """
        t0 = time.perf_counter()
        gen = self.exchange.check_office()
        chain, outside = journal_chain(self.exchange.journal())
        if outside:
            self.exchange.delete_journal(outside)
        by_seq = {int(e["seq"]): e for e in chain}
        first = int(chain[0]["seq"]) if chain else None
        like, _ = syncer.state_dict()
        chosen, skipped = None, []
        for step in sorted(self.store.steps(), reverse=True):
            try:
                arrays, meta = self.store.load(step, like)
            except Exception as exc:  # damaged or unreadable: the store names the file
                logger.warning("syncer checkpoint step %d is unusable (%s); trying an older one", step, exc)
                skipped.append(step)
                continue
            seq, g = int(meta["seq"]), int(meta["generation"])
            entry = by_seq.get(seq)
            if (entry is not None and int(entry["generation"]) == g) or (
                entry is None and (not chain or seq == first - 1)
            ):
                pass
            else:
                logger.warning(
                    "syncer checkpoint step %d (generation %d, seq %d) is not on the journal's valid "
                    "chain (a stale syncer's); trying an older one",
                    step,
                    g,
                    seq,
                )
                skipped.append(step)
                continue
            chosen = (step, arrays, meta)
            break
        for step in skipped:
            if chosen is None or step > chosen[0]:
                self.store.delete(step)
        if chosen is not None:
            step, arrays, meta = chosen
            syncer.load_state_dict(arrays, meta["syncer"], self.exchange.read_submission)
            self.seq = int(meta["seq"])
            self.received = {n: int(q) for n, q in meta["received"].items()}
            loop.update(meta["loop"])
            self._kept = [(step, self.seq, _pending_names(syncer))]
            self._last_checkpoint_seq = self.seq
        elif chain and first != 1:
            raise JournalMismatchError(
                f"the journal starts at seq {first} but no usable syncer checkpoint covers "
                f"seqs 1..{first - 1}: the syncer cannot be rebuilt"
            )
        self.exchange.skip_drained(self.received)
        replayed = republished = 0
        for entry in chain:
            seq = int(entry["seq"])
            if seq <= self.seq:
                continue
            if seq != self.seq + 1:
                raise JournalMismatchError(f"journal gap: entry {self.seq + 1} is missing before entry {seq}")
            self._replay(syncer, entry)
            replayed += 1
            p = entry["merge"]
            if p is not None and entry["version"] is not None:
                published = self.exchange.versions()[p]
                rec = self._last_record
                if published < syncer.versions[p]:
                    self.exchange.publish(p, syncer.versions[p], syncer.global_params[p])
                    republished += 1
                on_merge({**rec, "replayed": True})
            loop.update(entry.get("loop") or {})
        self.exchange.refresh()
        published = self.exchange.versions()
        for p, v in enumerate(published):
            if v > syncer.versions[p]:
                raise JournalMismatchError(
                    f"fragment {p} is published at version {v} but the journal ends at version {syncer.versions[p]}: "
                    "a merge was published without its journal entry (a stale syncer's write)"
                )
        self.recovery = {
            "generation": gen,
            "checkpoint_step": chosen[0] if chosen else None,
            "checkpoint_seq": int(chosen[2]["seq"]) if chosen else None,
            "replayed": replayed,
            "republished": republished,
            "skipped_checkpoints": skipped,
            "recover_s": time.perf_counter() - t0,
        }
        return self.recovery

    def _replay(self, syncer: Syncer, entry: dict) -> None:
        seq = int(entry["seq"])
        for name, t in entry["received"]:
            syncer.receive(self.exchange.read_submission(name), float(t))
            self.received[name] = seq
            self.exchange.skip_drained([name])
        self._last_record = None
        p = entry["merge"]
        if p is not None:
            try:
                rec = syncer.merge(int(p), float(entry["t"]))
            except ValueError as exc:
                raise JournalMismatchError(f"journal entry {seq}: {exc}") from None
            version = None if rec is None else rec["version"]
            if version != entry["version"]:
                raise JournalMismatchError(
                    f"journal entry {seq}: merging fragment {p} gave version {version}, "
                    f"the journal records {entry['version']}"
                )
            digest = tensors_digest(syncer.global_params[int(p)])
            if digest != entry["sha256"]:
                raise JournalMismatchError(
                    f"journal entry {seq}: fragment {p} v{version} has sha256 {digest[:12]}…, "
                    f"the journal records {str(entry['sha256'])[:12]}…"
                )
            self._last_record = rec
        self.seq = seq

    # -- the running syncer -----------------------------------------------------------------------
    def note_received(self, sub, now: float) -> None:
        """``sub`` (with its object name ``key``) was handed to ``Syncer.receive`` at ``now`` (s)."""
        self._buffer.append([sub.key, now])
        self.received[sub.key] = None

    def _write(self, merge: int | None, now: float, version: int | None, digest: str | None, loop: dict) -> None:
        entry = {
            "format": FORMAT,
            "seq": self.seq + 1,
            "received": self._buffer,
            "merge": merge,
            "t": now,
            "version": version,
            "sha256": digest,
            "loop": dict(loop),
        }
        self.exchange.write_journal(entry)
        self.seq += 1
        for name, _ in self._buffer:
            self.received[name] = self.seq
        self._buffer = []

    def note_merge(self, syncer: Syncer, p: int, record: dict | None, now: float, loop: dict) -> None:
        """Journal ``Syncer.merge(p, now)`` (``record``: its result, None if refused); call it before
        the merge is published."""
        self._write(
            p, now, None if record is None else record["version"], tensors_digest(syncer.global_params[p]), loop
        )

    def maybe_checkpoint(self, syncer: Syncer, loop: dict, now: float, force: bool = False) -> bool:
        """Checkpoint if ``checkpoint_every_s`` seconds have passed since the last one (or ``force``)
        and the syncer moved since; then collect garbage. Returns True if it wrote one."""
        if not force and (
            self.checkpoint_every_s <= 0 or self.clock() - self._last_checkpoint_at < self.checkpoint_every_s
        ):
            return False
        self._last_checkpoint_at = self.clock()
        if self._buffer:
            self._write(None, now, None, None, loop)  # receipts only: the checkpoint sits at an entry
        if self.seq == 0 or self.seq == self._last_checkpoint_seq:
            return False  # nothing happened since (or at all: Θ₀ is the origin)
        gen = self.exchange.check_office()
        arrays, state = syncer.state_dict()
        meta = {
            "format": FORMAT,
            "generation": gen,
            "seq": self.seq,
            "t": now,
            "loop": dict(loop),
            "received": {n: q for n, q in self.received.items()},
            "syncer": state,
        }
        step = gen * STEP_STRIDE + self.seq
        self.store.save(step, arrays, meta)
        self.exchange.check_office()
        self._kept = (self._kept + [(step, self.seq, _pending_names(syncer))])[-2:]
        self._last_checkpoint_seq = self.seq
        self._collect()
        return True

    def finish(self, syncer: Syncer, loop: dict, now: float) -> None:
        """The last checkpoint (after the final flush); then every submission and journal entry it
        covers is deleted: the run is over, and its end state is in that checkpoint and the model's."""
        self.maybe_checkpoint(syncer, loop, now, force=True)
        self._collect(final=True)

    def _collect(self, final: bool = False) -> None:
        if not self._kept or (len(self._kept) < 2 and not final):
            return  # before the second checkpoint a restart may need the whole journal
        _, horizon, pending = self._kept[-1 if final else 0]
        done = sorted(n for n, q in self.received.items() if q is not None and q <= horizon and n not in pending)
        if done:
            self.exchange.discard(done)
            for n in done:
                del self.received[n]
        self.exchange.delete_journal([n for n in self.exchange.journal_names() if journal_seq(n) <= horizon])
