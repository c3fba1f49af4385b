"""The durable exchange: learners and the syncer in separate processes or hosts, through fsspec storage.

Any fsspec URL of one filesystem works: a local folder (the default, inside the run directory;
an absolute or relative path, ``~``, ``file://`` or ``local://``), ``memory://`` (one process; tests),
``s3://``/``gs://`` for clusters. Chained URLs (``simplecache::s3://…``, ``zip://…::file://…``) are
refused naming the layer (:func:`check_url`): a caching layer serves stale copies of the objects the
exchange rewrites (``state.json``, the heartbeats), so a learner would never see a new grant, and an
archive is read-only. :func:`check_writable` creates the root and writes, reads and deletes a probe
object (the CLI's checks run it before Prefect starts).

Every object is immutable once visible and
becomes visible whole: on a local filesystem it is written under ``tmp/`` and renamed into place
(``rename`` is atomic within one filesystem); elsewhere it is one PUT (``pipe_file``), which object
stores and the memory filesystem make visible at once or not at all. A reader therefore never sees
a half-written object; one that is truncated or corrupted anyway (a bad disk, a copy by hand) fails
its checksum and is quarantined, never merged. A local write that fails (a full disk) deletes its
temporary object before it raises; one whose process was killed mid-write leaves it, named
``tmp/<host>-<pid>-<id>.part``, and the next process that opens the exchange on that host deletes
the temporary objects of writers that are gone. On an object store (s3fs, gcsfs) every listing and
existence check is read from the store afresh: those filesystems cache listings per instance, and a
cached one never shows what another process wrote. No bucket is ever created: it must exist.

Layout under the exchange root::

    meta.json                       fragments P, token budget, the clock's origin (Unix seconds)
    inbox/<t>-l<m>-f<p>-a<attempt>-s<step>-<id>.safetensors    submissions, learner m → syncer
    global/f<p>/v<version>.safetensors                         published Θ_p, syncer → learners
    origin/f<p>.safetensors         Θ₀ of fragment p, kept for good (a restart with no checkpoint)
    journal/<seq>-g<generation>.json    the syncer's write-ahead journal (diloco.syncer_journal)
    state.json                      the syncer's pointer: generation, versions, token grants, closed
    learners/l<m>.json              learner m's heartbeat (status, step, counters, tokens claimed)
    syncer/generation               the fencing token: the generation of the syncer in charge
    tmp/<host>-<pid>-<id>.part      a local write in progress (renamed into place when whole)
    learners_done                   written by the flow once every learner task has ended
    stop                            written by the flow when a stop signal reached it
    quarantine/<name>               objects that failed their checks, with <name>.reason

Arrays are **safetensors**: a standard, framework-neutral format with no pickle (a worker never
executes what it reads), a JSON header that carries the manifest (``__metadata__``: learner,
fragment, attempt, local step, tokens, steps, base version, send time, wire format, sha256 of the
tensor bytes) and zero-copy reads. A submission's tensors are its payload as sent: float32 θ, or the
codes and scales of a quantised update (``diloco.wire``); the sha256 covers exactly those bytes.
Published fragments are always float32. One object per submission or published fragment, so a
manifest can never describe another object's bytes.

Every object has exactly one writer: learner m writes its submissions and its heartbeat, the syncer
in charge writes ``global/``, ``journal/``, ``state.json`` and quarantines, the flow writes
``learners_done``.

**Token budget across processes** (no compare-and-swap needed, so it works on any store): the syncer
is the only authority. ``state.json`` holds per learner a cumulative *grant*; the syncer tops a
learner's grant up by ``grant_tokens`` whenever the learner has less than half of that left
unclaimed, until the grants sum to the budget. A learner claims from its own grant only, and makes
every claim durable (its heartbeat, rewritten with the new ``claimed`` total) before it takes the
step, so a submission never carries unclaimed tokens. Sum of claims ≤ sum of grants ≤ budget: a
learner dying mid-claim cannot over-spend, and its retry continues from the claims it made durable.
A learner that fails for good leaves at most one grant unspent. A learner whose grant is used up
waits for the next top-up (it polls ``state.json``) and stops once the budget is fully granted and
its own grant is spent.

**Fencing.** A syncer takes office with :meth:`FsspecExchange.take_office`, which increments
``syncer/generation``. Every later write of that syncer (publish, state, journal, deleting inbox
objects or journal entries, close; its checkpoints too) first reads the
generation and raises :class:`StaleSyncerError` if a newer syncer has taken office, and every
published object and ``state.json`` carry the writer's generation; learners ignore a ``state.json``
of an older generation than one they have seen. Without conditional writes the check and the write
are two operations: a stale syncer can slip at most one write into that window.

**A syncer that survives** (``diloco.syncer_journal``, the syncer's side; this module stores its
objects). The syncer is a deterministic state machine, so its state is a checkpoint (Orbax, in the
run directory, every ``diloco.syncer_checkpoint_every_s`` seconds and at the end) plus the journal
of what it did since: before it publishes a merge it writes ``journal/<seq>-g<generation>.json``
(:meth:`write_journal`: fenced, atomic) naming the inbox objects it received since the previous
entry (with their receive times), the fragment it merged and the version and sha256 it produced.
A restarted syncer takes office, loads its newest intact checkpoint (or starts from ``origin/``),
re-reads the pending submissions it names from the inbox (:meth:`read_submission`), replays every
later entry (the same receives, the same merges, checked against the recorded version and sha256)
and publishes only what the exchange's pointer shows as not yet published. No merge is lost: one
whose entry was never written was never published, and its submissions are still in the inbox, so
the new syncer receives and merges them again. None is repeated: a journaled merge is published
by the replay only when the pointer is behind it. Drain skips every object already received
(:meth:`skip_drained`). The generation in each entry's name keeps an entry a stale syncer slips
in from overwriting its successor's.

Garbage collection: without a journal the syncer deletes a submission once it is merged or dropped
(:meth:`discard`); with one, only once two checkpoints cover it, and journal entries likewise
(``diloco.syncer_journal``). The newest ``keep_versions`` published versions of each fragment are
kept; readers that lose a race with a deletion re-read the pointer.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Mapping

import fsspec
import numpy as np
from safetensors.numpy import load as st_load, save as st_save

from diloco.exchange.base import Submission

FORMAT = 1
# A heartbeat that only updates counters is written at most this often (or every ``poll_s``, if
# longer): every step's claim rewrites the same file with the counters as of the step before, so a
# second write per step (learner steps of 30-35 ms on the default config) bought nothing but a file
# created and renamed; liveness (``diloco.heartbeat_timeout_s``, 1 s or more) still sees a write at
# least every loop iteration longer than this.
BEAT_EVERY_S = 0.25


class StaleSyncerError(RuntimeError):
    """A newer syncer has taken office (a higher generation): this one must stop writing."""


class CorruptObjectError(ValueError):
    """An object failed to parse, its manifest is incomplete or its checksum does not match."""


def tensors_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """sha256 (hex) over the tensors in name order: name, dtype, shape and bytes of each."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        a = np.ascontiguousarray(tensors[k])
        h.update(f"{k}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def encode(tensors: Mapping[str, np.ndarray], manifest: Mapping[str, object]) -> bytes:
    """One safetensors object: the tensors plus the manifest (JSON values) and their sha256."""
    meta = {k: json.dumps(v) for k, v in manifest.items()}
    meta["sha256"] = json.dumps(tensors_digest(tensors))
    return st_save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=meta)


def decode(data: bytes) -> tuple[dict[str, np.ndarray], dict]:
    """``(tensors, manifest)`` of an object written by :func:`encode`.

    Raises :class:`CorruptObjectError` if the bytes are not a whole safetensors object, the manifest
    is missing or the checksum does not match the tensors."""
    try:
        n = int.from_bytes(data[:8], "little")
        if len(data) < 8 + n:
            raise ValueError(f"truncated: header declares {n} bytes, {len(data) - 8} present")
        header = json.loads(data[8 : 8 + n])
        meta = {k: json.loads(v) for k, v in (header.get("__metadata__") or {}).items()}
        tensors = st_load(bytes(data))
    except Exception as exc:  # safetensors raises its own error type; json a ValueError
        raise CorruptObjectError(f"unreadable object: {exc}") from None
    if "sha256" not in meta:
        raise CorruptObjectError("no checksum in the manifest")
    if tensors_digest(tensors) != meta["sha256"]:
        raise CorruptObjectError("checksum mismatch (the tensor bytes changed after they were written)")
    return tensors, meta


# fsspec's caching layers: chained in front of a store they serve reads from a copy
_CACHING = ("simplecache", "filecache", "blockcache", "cached")


def check_url(url: str) -> None:
    """Refuse the URL forms the exchange cannot use: chained URLs (``a::b``). Raises ``ValueError``
    naming the form and the URL to give instead; returns None for one filesystem's URL (whether it
    can be written is :func:`check_writable`'s question)."""
    url = str(url)
    if "::" not in url:
        return
    outer, inner = url.split("::", 1)
    layer = outer.split("://", 1)[0]
    storage = inner.rsplit("::", 1)[-1]
    if layer in _CACHING:
        why = (
            f"a chained URL through {layer}:: caches what it reads, and the exchange rewrites state.json "
            "and the heartbeats in place (learners would never see a new grant)"
        )
    else:
        why = (
            f"a chained URL ({layer}://…::…) reads through another filesystem (an archive is read-only); "
            "the exchange writes objects and renames them into place"
        )
    raise ValueError(f"{url}: {why}; give the storage URL itself, e.g. {storage}")


def check_writable(url: str, storage_options: dict | None = None) -> None:
    """Check that an exchange can live under ``url``: :func:`check_url`, then create the root, write,
    read back and delete a probe object (on an object store the bucket must exist: none is created).
    Folders the check created on a local filesystem are removed
    again, deepest first and only while empty (another run may have started writing in them
    meanwhile: nothing of its is touched), so a passed check leaves nothing of its own. Raises
    ``ValueError`` for a refused form and whatever the filesystem raises (``OSError``,
    ``PermissionError``, ``NotImplementedError``, …) when the root cannot be created, written or
    read."""
    check_url(url)
    # a new instance: a cached one keeps the credentials it was made with, and the check is of now's
    fs, root = fsspec.url_to_fs(str(url), skip_instance_cache=True, **(storage_options or {}))
    root = root.rstrip("/") or "/"
    local = "file" in fs.protocol or "local" in fs.protocol
    created: list[str] = []  # the folders this check makes, outermost first
    if local:
        top = root
        while not fs.exists(top):
            created.insert(0, top)
            top = top.rsplit("/", 1)[0] or "/"
    try:
        if local:  # (on an object store a prefix needs no creating, and a bucket is never created here)
            fs.makedirs(root, exist_ok=True)
        probe = f"{root.rstrip('/')}/.exchange-probe-{uuid.uuid4().hex}"
        fs.pipe_file(probe, b"probe")
        try:
            if fs.cat_file(probe) != b"probe":
                raise OSError(f"{url}: a probe object read back different bytes than were written")
        finally:
            fs.rm(probe)
    finally:
        for folder in reversed(created):
            try:
                os.rmdir(folder)  # never recursive: a folder in use by another run is not empty
            except OSError:
                break


def _tmp_name() -> str:
    """A temporary object's name: this host and process (see :meth:`FsspecExchange._remove_dead_tmp`)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}.part"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


_SUBMISSION_FIELDS = ("learner", "fragment", "attempt", "local_step", "tokens", "steps", "base_version", "sent_at")


class FsspecExchange:
    """The exchange interface (``diloco.exchange.base.Exchange``) over an fsspec URL.

    Create the exchange once per run with :meth:`create` (the process that sets the run up), open it
    anywhere else with :meth:`open`. One instance may be shared by the threads of a process.

    Args:
        url: the exchange root (``/abs/folder``, ``file://…``, ``memory://…``, ``s3://…``).
        poll_s: how long a read of ``state.json`` or of the heartbeats is reused (seconds) before
            storage is read again; bounds the store's request rate per process.
        storage_options: passed to ``fsspec.url_to_fs`` (credentials, endpoints).

    Raises ``FileNotFoundError`` (naming the URL) if no exchange was created there, ``ValueError``
    for a chained URL (:func:`check_url`).
    """

    def __init__(self, url: str, *, poll_s: float = 0.02, storage_options: dict | None = None):
        check_url(url)
        self.url = str(url)
        self.fs, root = fsspec.url_to_fs(self.url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.poll_s = float(poll_s)
        self._local = "file" in self.fs.protocol or "local" in self.fs.protocol
        try:
            meta = json.loads(self.fs.cat_file(self._p("meta.json")))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no exchange at {self.url} (meta.json missing): the syncer's "
                "set-up creates it before any learner starts"
            ) from None
        if meta.get("format") != FORMAT:
            raise ValueError(f"exchange at {self.url} has format {meta.get('format')}, expected {FORMAT}")
        self.num_fragments = int(meta["num_fragments"])
        self.num_learners = int(meta["num_learners"])
        self.token_budget = int(meta["token_budget"])
        self.grant_tokens = int(meta["grant_tokens"])
        self.keep_versions = int(meta.get("keep_versions", 2))
        self._t0 = float(meta["t0"])
        self._lock = threading.RLock()
        self.io_s = 0.0  # seconds this instance spent in storage calls, encoding and checksums
        self._folders: set[str] = set()  # local folders known to exist
        self._beat_written: dict[int, float] = {}  # learner → monotonic time of its last heartbeat write
        self._state: dict | None = None
        self._state_at = -1e18
        self._beats: dict[int, dict] = {}  # the heartbeats this process writes (learner → info)
        self._others: dict[int, dict] = {}
        self._others_at = -1e18
        self._seen: set[str] = set()  # inbox objects drained by this (syncer) instance
        self._events: list[dict] = []
        self._generation: int | None = None  # set once this instance is a syncer in office
        self._max_generation_seen = 0
        self._stop_seen, self._stop_at = False, -1e18
        if self._local:
            self._remove_dead_tmp()

    def _remove_dead_tmp(self) -> None:
        """Delete ``tmp/`` objects left by writers on this host that are gone (killed mid-write);
        those of live processes and of other hosts are kept."""
        host = socket.gethostname()
        for name in self._ls(self._p("tmp")):
            parts = name[: -len(".part")].rsplit("-", 2) if name.endswith(".part") else []
            if len(parts) == 3 and parts[0] == host and parts[1].isdigit() and not _pid_alive(int(parts[1])):
                try:
                    self.fs.rm(self._p("tmp", name))
                except FileNotFoundError:
                    pass

    # -- creation -------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        url: str,
        *,
        initial: list[dict[str, np.ndarray]],
        num_learners: int,
        token_budget: int,
        grant_tokens: int,
        keep_versions: int = 2,
        poll_s: float = 0.02,
        storage_options: dict | None = None,
    ) -> FsspecExchange:
        """Create the exchange at ``url`` holding version 0 of every global fragment (``initial``:
        Θ₀ as P name → float32 array mappings), the clock starting now, and open it.

        ``grant_tokens``: the syncer's top-up of a learner's token grant, and every learner's first
        grant (tokens; e.g. H inner steps' worth). ``keep_versions``: published versions kept per
        fragment. Raises ``FileExistsError`` if ``url`` already holds an exchange, ``ValueError`` for
        counts below 1.
        """
        num_fragments = len(initial)
        for name, v in (
            ("fragments", num_fragments),
            ("num_learners", num_learners),
            ("token_budget", token_budget),
            ("grant_tokens", grant_tokens),
            ("keep_versions", keep_versions),
        ):
            if int(v) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {v}")
        check_url(url)
        fs, root = fsspec.url_to_fs(str(url), **(storage_options or {}))
        root = root.rstrip("/")
        fs.invalidate_cache(root)  # (an object store's cached listing may predate another process's exchange)
        if fs.exists(f"{root}/meta.json"):
            raise FileExistsError(f"an exchange already exists at {url}")
        if "file" in fs.protocol or "local" in fs.protocol:  # (an object store's prefix needs no folder)
            fs.makedirs(root, exist_ok=True)
        meta = {
            "format": FORMAT,
            "num_fragments": int(num_fragments),
            "num_learners": int(num_learners),
            "token_budget": int(token_budget),
            "grant_tokens": int(grant_tokens),
            "keep_versions": int(keep_versions),
            "t0": time.time(),
        }
        fs.pipe_file(f"{root}/meta.json", json.dumps(meta).encode())
        ex = cls(url, poll_s=poll_s, storage_options=storage_options)
        first = min(ex.grant_tokens, ex.token_budget // ex.num_learners) or 1
        for p, params in enumerate(initial):
            data = ex._io(encode, params, {"fragment": p, "version": 0, "generation": 0})
            ex._put(ex._p("origin", f"f{p:03d}.safetensors"), data)  # kept for good (see origin())
            ex._put(ex._p("global", f"f{p:03d}", f"v{0:08d}.safetensors"), data)
        ex._write_state(
            {
                "generation": 0,
                "versions": [0] * ex.num_fragments,
                "grants": {str(m): first for m in range(ex.num_learners)},
                "closed": False,
            }
        )
        return ex

    @classmethod
    def open(cls, url: str, **kwargs) -> FsspecExchange:
        """Open the exchange created at ``url`` (see the constructor)."""
        return cls(url, **kwargs)

    # -- storage primitives ---------------------------------------------------------------------
    def _p(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _io(self, fn, *args, **kwargs):
        """Call ``fn`` and add its seconds to :attr:`io_s` (storage calls, encoding and checksums)."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.io_s += time.perf_counter() - t0

    def _put(self, path: str, data: bytes) -> None:
        """Make ``data`` visible at ``path`` whole or not at all."""
        self._io(self._put_now, path, data)

    def _put_now(self, path: str, data: bytes) -> None:
        if self._local:
            tmp = self._p("tmp", _tmp_name())
            for folder in (self._p("tmp"), path.rsplit("/", 1)[0]):
                if folder not in self._folders:
                    self.fs.makedirs(folder, exist_ok=True)
                    self._folders.add(folder)
            try:
                with self.fs.open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)  # atomic within one filesystem
            except BaseException:  # a full disk, a signal: no temporary object stays behind
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                raise
        else:
            self.fs.pipe_file(path, data)

    def _get(self, path: str) -> bytes:
        return self._io(self.fs.cat_file, path)

    def _fresh(self, path: str) -> str:
        """``path``, with this process's cached listings of it and its parents dropped: object-store
        filesystems (s3fs, gcsfs) cache listings per instance and never learn of objects another
        process wrote, so a syncer would never see a new submission or heartbeat."""
        if not self._local:
            self.fs.invalidate_cache(path)
        return path

    def _ls(self, path: str) -> list[str]:
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self._io(self.fs.ls, self._fresh(path), detail=False)]
        except FileNotFoundError:
            return []

    def _exists(self, path: str) -> bool:
        return self._io(self.fs.exists, self._fresh(path))

    # -- the syncer's pointer (state.json) ------------------------------------------------------
    def _read_state(self, fresh: bool = False) -> dict:
        with self._lock:
            now = time.monotonic()
            if fresh or self._state is None or now - self._state_at > self.poll_s:
                state = json.loads(self._get(self._p("state.json")))
                # a pointer of an older generation than one already seen comes from a stale syncer
                if self._state is None or state["generation"] >= self._max_generation_seen:
                    self._state = state
                    self._max_generation_seen = max(self._max_generation_seen, state["generation"])
                self._state_at = now
            return self._state

    def _write_state(self, state: dict) -> None:
        with self._lock:
            self._put(self._p("state.json"), json.dumps(state).encode())
            self._state, self._state_at = state, time.monotonic()

    # -- syncer office and fencing --------------------------------------------------------------
    def generation(self) -> int:
        """The generation of the syncer in charge (0 before any took office)."""
        try:
            return int(self._get(self._p("syncer", "generation")))
        except FileNotFoundError:
            return 0

    def take_office(self) -> int:
        """Become the syncer in charge: generation + 1 (a previous syncer's writes are refused from
        now on). Returns the new generation."""
        with self._lock:
            gen = self.generation() + 1
            self._put(self._p("syncer", "generation"), str(gen).encode())
            self._generation = gen
            state = dict(self._read_state(fresh=True))
            state["generation"] = gen
            self._write_state(state)
            self._max_generation_seen = gen
            return gen

    def check_office(self) -> int:
        """This syncer's generation if it is still the one in charge. Raises :class:`StaleSyncerError`
        if a newer syncer has taken office, ``RuntimeError`` if this instance never took office."""
        return self._check_office()

    def _check_office(self) -> int:
        if self._generation is None:
            raise RuntimeError("only a syncer that has taken office (take_office) may write the exchange's state")
        current = self.generation()
        if current != self._generation:
            raise StaleSyncerError(
                f"syncer of generation {self._generation} is stale: generation {current} has taken office"
            )
        return self._generation

    # -- learners → syncer ----------------------------------------------------------------------
    def submit(self, sub: Submission) -> None:
        """Write one submission object (atomic); sets ``sub.key`` to its object name."""
        manifest = {k: getattr(sub, k) for k in (*_SUBMISSION_FIELDS, "wire")}
        manifest["sent_at"] = self.clock()
        ms = int(manifest["sent_at"] * 1000)
        name = (
            f"{ms:012d}-l{sub.learner:03d}-f{sub.fragment:03d}-a{sub.attempt:03d}-s{sub.local_step:09d}-"
            f"{uuid.uuid4().hex[:8]}.safetensors"
        )
        self._put(self._p("inbox", name), self._io(encode, sub.params, manifest))
        sub.key = name

    def drain(self) -> list[Submission]:
        """Submissions not drained before by this instance, in send order (the syncer's side).

        An object that fails its checks is moved to ``quarantine/`` with the reason and reported by
        :meth:`take_events`; it never reaches the syncer."""
        names = sorted(n for n in self._ls(self._p("inbox")) if n.endswith(".safetensors") and n not in self._seen)
        out = []
        for name in names:
            self._seen.add(name)
            try:
                sub = self._load_submission(name)
            except FileNotFoundError:
                continue
            except CorruptObjectError as exc:
                self._quarantine(name, str(exc))
                continue
            out.append(sub)
        return out

    def _load_submission(self, name: str) -> Submission:
        tensors, meta = self._io(decode, self._get(self._p("inbox", name)))
        missing = [k for k in _SUBMISSION_FIELDS if k not in meta]
        if missing:
            raise CorruptObjectError(f"manifest lacks {missing}")
        return Submission(
            learner=int(meta["learner"]),
            fragment=int(meta["fragment"]),
            params=tensors,
            tokens=int(meta["tokens"]),
            steps=int(meta["steps"]),
            base_version=int(meta["base_version"]),
            local_step=int(meta["local_step"]),
            attempt=int(meta["attempt"]),
            sent_at=float(meta["sent_at"]),
            key=name,
            wire=str(meta.get("wire", "float32")),
        )  # objects written before wire formats: float32

    def read_submission(self, name: str) -> Submission:
        """The submission stored in ``inbox/<name>`` (a restarted syncer re-reads what its predecessor
        received). Raises ``FileNotFoundError`` naming the object if it is gone, and
        :class:`CorruptObjectError` if it no longer passes its checks."""
        try:
            return self._load_submission(name)
        except FileNotFoundError:
            raise FileNotFoundError(f"submission {name} is no longer in {self.url}/inbox") from None
        except CorruptObjectError as exc:
            raise CorruptObjectError(f"submission {name}: {exc}") from None

    def skip_drained(self, names: Iterable[str]) -> None:
        """Never hand ``names`` out of :meth:`drain` (a restarted syncer already holds them)."""
        self._seen.update(names)

    def _quarantine(self, name: str, reason: str) -> None:
        src, dst = self._p("inbox", name), self._p("quarantine", name)
        try:
            self.fs.makedirs(self._p("quarantine"), exist_ok=True)
            self._io(self.fs.mv, src, dst)
        except FileNotFoundError:
            pass
        self._put(self._p("quarantine", name + ".reason"), reason.encode())
        learner = _field_of(name, "l")
        with self._lock:
            self._events.append(
                {
                    "event": "quarantined",
                    "object": name,
                    "reason": reason,
                    "learner": learner,
                    "fragment": _field_of(name, "f"),
                    "t": self.clock(),
                }
            )

    def discard(self, keys: Iterable[str]) -> None:
        """Delete drained submissions the syncer is done with (merged or dropped). A syncer in office
        is fenced first (:class:`StaleSyncerError`: a stale syncer must not delete objects its
        successor still needs)."""
        paths = [self._p("inbox", k) for k in keys]
        if paths:
            if self._generation is not None:
                self._check_office()
            try:
                self._io(self.fs.rm, paths)
            except FileNotFoundError:
                for p in paths:
                    try:
                        self._io(self.fs.rm, p)
                    except FileNotFoundError:
                        pass

    def take_events(self) -> list[dict]:
        """Exchange events since the last call (quarantined objects), oldest first."""
        with self._lock:
            out, self._events = self._events, []
        return out

    # -- syncer → learners ----------------------------------------------------------------------
    def publish(self, fragment: int, version: int, params: dict[str, np.ndarray]) -> None:
        """Publish Θ_p at ``version`` (object first, then the pointer). Raises
        :class:`StaleSyncerError` if a newer syncer is in office, ``ValueError`` if ``version`` is not
        above the published one (a repeat)."""
        with self._lock:
            gen = self._check_office()
            state = dict(self._read_state(fresh=True))
            versions = list(state["versions"])
            if version <= versions[fragment]:
                raise ValueError(
                    f"fragment {fragment}: version {version} is not above the published {versions[fragment]}"
                )
            manifest = {"fragment": fragment, "version": version, "generation": gen}
            self._put(
                self._p("global", f"f{fragment:03d}", f"v{version:08d}.safetensors"), self._io(encode, params, manifest)
            )
            self._check_office()
            versions[fragment] = version
            state["versions"] = versions
            self._write_state(state)
            old = sorted(self._ls(self._p("global", f"f{fragment:03d}")))[: -self.keep_versions]
            if old:
                self._io(self.fs.rm, [self._p("global", f"f{fragment:03d}", n) for n in old])

    def latest(self, fragment: int) -> tuple[int, dict[str, np.ndarray]]:
        """``(version, params)`` of the newest published Θ_p; ``RuntimeError`` before the first."""
        for fresh in (False, True, True):
            version = self._read_state(fresh=fresh)["versions"][fragment]
            if version < 0:
                raise RuntimeError(f"fragment {fragment} has not been published by the syncer yet")
            try:
                tensors, meta = self._io(
                    decode, self._get(self._p("global", f"f{fragment:03d}", f"v{version:08d}.safetensors"))
                )
            except FileNotFoundError:
                continue  # garbage-collected under us: a newer version exists
            if int(meta["version"]) != version or int(meta["fragment"]) != fragment:
                raise CorruptObjectError(
                    f"fragment {fragment} v{version}: manifest says fragment {meta['fragment']} v{meta['version']}"
                )
            return version, tensors
        raise RuntimeError(f"fragment {fragment}: the published version kept disappearing")

    def versions(self) -> list[int]:
        return list(self._read_state()["versions"])

    def origin(self, fragment: int) -> dict[str, np.ndarray]:
        """Θ₀ of ``fragment``: version 0 as :meth:`create` wrote it, kept in ``origin/`` for good (the
        published copy is garbage-collected): a restarted syncer with no usable checkpoint replays
        its journal from here. Raises ``FileNotFoundError`` if it is missing, :class:`CorruptObjectError`
        if damaged."""
        tensors, meta = self._io(decode, self._get(self._p("origin", f"f{fragment:03d}.safetensors")))
        if int(meta["version"]) != 0 or int(meta["fragment"]) != fragment:
            raise CorruptObjectError(
                f"fragment {fragment} v0: manifest says fragment {meta['fragment']} v{meta['version']}"
            )
        return tensors

    # -- the syncer's write-ahead journal -------------------------------------------------------
    def write_journal(self, entry: Mapping[str, object]) -> str:
        """Write one journal entry (JSON) as ``journal/<seq:010d>-g<generation:06d>.json``, atomically,
        after checking office; ``entry["seq"]`` (int ≥ 1) is required and ``generation`` is set here.
        Returns the object name. Raises :class:`StaleSyncerError` if a newer syncer is in office.

        The generation is part of the name so that an entry a stale syncer slips in (the check and
        the write are two operations) never overwrites its successor's entry of the same ``seq``."""
        with self._lock:
            gen = self._check_office()
            seq = int(entry["seq"])
            if seq < 1:
                raise ValueError(f"journal seq must be ≥ 1, got {seq}")
            name = f"{seq:010d}-g{gen:06d}.json"
            self._put(self._p("journal", name), json.dumps({**entry, "generation": gen}).encode())
            return name

    def journal(self) -> list[tuple[str, dict]]:
        """Every journal entry in storage as ``(object name, entry)``, by (seq, generation). Raises
        :class:`CorruptObjectError` naming an entry that does not parse (entries are written whole)."""
        out = []
        for name in self.journal_names():
            try:
                entry = json.loads(self._get(self._p("journal", name)))
            except FileNotFoundError:
                continue  # deleted under us by the syncer in office
            except ValueError as exc:
                raise CorruptObjectError(f"journal entry {name} does not parse: {exc}") from None
            out.append((name, entry))
        return out

    def journal_names(self) -> list[str]:
        """Object names of the journal entries in storage, sorted (by seq, then generation)."""
        return sorted(n for n in self._ls(self._p("journal")) if n.endswith(".json"))

    def delete_journal(self, names: Iterable[str]) -> None:
        """Delete journal entries (by object name) after checking office (:class:`StaleSyncerError`)."""
        paths = [self._p("journal", n) for n in names]
        if not paths:
            return
        self._check_office()
        for path in paths:
            try:
                self._io(self.fs.rm, path)
            except FileNotFoundError:
                pass

    def refresh(self) -> None:
        """Forget cached reads: the next read of the pointer and the heartbeats goes to storage."""
        with self._lock:
            self._state_at = self._others_at = -1e18

    # -- liveness and progress ------------------------------------------------------------------
    def _beat_of(self, learner: int) -> dict:
        with self._lock:
            if learner not in self._beats:
                try:
                    self._beats[learner] = json.loads(self._get(self._p("learners", f"l{learner:03d}.json")))
                except FileNotFoundError:
                    self._beats[learner] = {"claimed": 0}
            return self._beats[learner]

    def heartbeat(self, learner: int, **info) -> None:
        """Merge ``info`` into learner ``learner``'s heartbeat (and ``last_seen``, Unix s) and rewrite
        it; a beat that only updates counters (no ``status``) is written at most every
        ``max(poll_s, BEAT_EVERY_S)`` seconds after the learner's last write: the next claim
        (written every step, :meth:`claim_tokens`) carries it anyway."""
        with self._lock:
            beat = self._beat_of(learner)
            beat.update(info)
            now = time.monotonic()
            quiet = max(self.poll_s, BEAT_EVERY_S)
            if "status" not in info and now - self._beat_written.get(learner, -1e18) < quiet:
                return
            self._write_beat(learner, beat, now)

    def _write_beat(self, learner: int, beat: dict, now: float) -> None:
        beat["last_seen"] = time.time()
        self._put(self._p("learners", f"l{learner:03d}.json"), json.dumps(beat).encode())
        self._beat_written[learner] = now

    def learners(self) -> dict[int, dict]:
        """Every learner's last heartbeat; ``last_seen`` converted to this process's monotonic clock
        (as the in-process exchange reports it)."""
        with self._lock:
            now = time.monotonic()
            if now - self._others_at > self.poll_s:
                out = {}
                for name in self._ls(self._p("learners")):
                    if not name.endswith(".json"):
                        continue
                    try:
                        info = json.loads(self._get(self._p("learners", name)))
                    except (FileNotFoundError, ValueError):
                        continue
                    out[int(name[1:4])] = info
                self._others, self._others_at = out, now
            shift = time.monotonic() - time.time()
            return {m: {**v, "last_seen": v.get("last_seen", -1e18) + shift} for m, v in self._others.items()}

    # -- the global token budget ----------------------------------------------------------------
    def claim_tokens(self, n: int, learner: int | None = None, stop=None) -> bool:
        """Learner ``learner`` claims ``n`` tokens from its grant, durably; False once the budget is
        fully granted and its grant cannot cover ``n``, the run closed, or ``stop()`` is true. Waits
        for the syncer's next top-up otherwise (polling ``state.json`` every ``poll_s``). Raises
        ``TypeError`` without ``learner``."""
        if learner is None:
            raise TypeError("the fsspec exchange needs the claiming learner: claim_tokens(n, learner=m)")
        beat = self._beat_of(learner)
        while True:
            state = self._read_state()
            grant = int(state["grants"].get(str(learner), 0))
            if int(beat.get("claimed", 0)) + n <= grant:
                with self._lock:  # durable before the step it pays for, whatever the throttle
                    beat["claimed"] = int(beat.get("claimed", 0)) + n
                    self._write_beat(learner, beat, time.monotonic())
                return True
            if (
                state.get("closed")
                or (stop is not None and stop())
                or sum(int(g) for g in state["grants"].values()) >= self.token_budget
            ):
                state = self._read_state(fresh=True)
                grant = int(state["grants"].get(str(learner), 0))
                if int(beat.get("claimed", 0)) + n <= grant:
                    continue
                return False
            time.sleep(self.poll_s)

    def grant(self, live: set[int] | None = None) -> bool:
        """The syncer's top-up: every learner (of ``live``, default all) with less than half of
        ``grant_tokens`` left unclaimed gets ``grant_tokens`` more, while the budget lasts. Returns
        True if a grant changed (``state.json`` rewritten)."""
        with self._lock:
            state = self._read_state(fresh=True)
            grants = {m: int(g) for m, g in state["grants"].items()}
            left = self.token_budget - sum(grants.values())
            if left <= 0:
                return False
            beats = self.learners()
            changed = False
            for m in range(self.num_learners):
                if live is not None and m not in live:
                    continue
                info = beats.get(m, {})
                if info.get("status") == "done":
                    continue
                unclaimed = grants.get(str(m), 0) - int(info.get("claimed", 0))
                if unclaimed < self.grant_tokens / 2 and left > 0:
                    extra = min(self.grant_tokens, left)
                    grants[str(m)] = grants.get(str(m), 0) + extra
                    left -= extra
                    changed = True
            if changed:
                self._check_office()
                self._write_state({**state, "grants": grants})
            return changed

    @property
    def claimed_tokens(self) -> int:
        """Tokens claimed by all learners (their durable heartbeats)."""
        return int(sum(int(v.get("claimed", 0)) for v in self.learners().values()))

    # -- the run's clock and end ----------------------------------------------------------------
    def clock(self) -> float:
        """Seconds since the exchange was created (wall clock: one origin for every process)."""
        return time.time() - self._t0

    def close(self) -> None:
        """The run is over: learners stop at their next step boundary."""
        with self._lock:
            if self._generation is not None:
                self._check_office()
            state = dict(self._read_state(fresh=True))
            state["closed"] = True
            self._write_state(state)

    def is_closed(self) -> bool:
        return bool(self._read_state().get("closed"))

    def mark_learners_done(self) -> None:
        """Written by the flow once every learner task has ended (the syncer then flushes and ends)."""
        self._put(self._p("learners_done"), b"1")

    def learners_done(self) -> bool:
        return self._exists(self._p("learners_done"))

    def request_stop(self) -> None:
        """Written by the flow when a stop signal reached it: learners stop at their next step boundary."""
        self._put(self._p("stop"), b"1")

    def stop_requested(self) -> bool:
        """True once :meth:`request_stop` ran anywhere (checked at most every ``poll_s`` seconds)."""
        with self._lock:
            now = time.monotonic()
            if not self._stop_seen and now - self._stop_at > self.poll_s:
                self._stop_seen, self._stop_at = self._exists(self._p("stop")), now
            return self._stop_seen


def _field_of(name: str, letter: str) -> int | None:
    """The number after ``-<letter>`` in an inbox object name (``l`` learner, ``f`` fragment)."""
    for part in name.split("-"):
        if part.startswith(letter) and part[1:].isdigit():
            return int(part[1:])
    return None
