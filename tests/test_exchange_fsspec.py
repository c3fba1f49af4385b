"""The durable fsspec exchange on ``memory://``, a local folder and an S3 endpoint (moto's server, with
its credentials in the environment): atomic visibility, the token budget under racing claims (threads
and processes), manifests and checksums (corrupted or truncated objects quarantined, never merged),
fencing of a stale syncer, garbage collection, and credentials refused before work."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from diloco.exchange.base import Submission
from diloco.exchange.fsspec import CorruptObjectError, FsspecExchange, StaleSyncerError, decode, encode
from diloco.syncer import Syncer, SyncerSettings
from diloco.syncer_loop import SyncerHooks, run_syncer
from tests.conftest import S3_BUCKET
from tests.exchange_claimer import claim_until_refused


@pytest.fixture(params=["memory", "local", "s3"])
def url(request, tmp_path):
    if request.param == "memory":
        return f"memory://ex-{uuid.uuid4().hex}"
    if request.param == "s3":  # a local S3-compatible server (moto), credentials from the environment
        request.getfixturevalue("s3_env")
        return f"s3://{S3_BUCKET}/ex-{uuid.uuid4().hex}"
    return str(tmp_path / "exchange")


def theta0():
    return [{"a": np.zeros((4, 8), np.float32)}, {"b": np.zeros(16, np.float32)}]


def make(url, learners=2, budget=1000, grant=100, **kw):
    return FsspecExchange.create(
        url, initial=theta0(), num_learners=learners, token_budget=budget, grant_tokens=grant, poll_s=0.001, **kw
    )


def sub(m, p, value, tokens=10, base=0, step=1, attempt=1):
    shape = (4, 8) if p == 0 else (16,)
    name = "a" if p == 0 else "b"
    return Submission(
        learner=m,
        fragment=p,
        params={name: np.full(shape, value, np.float32)},
        tokens=tokens,
        steps=1,
        base_version=base,
        local_step=step,
        attempt=attempt,
    )


# -- objects -------------------------------------------------------------------------------------
def test_object_round_trip_and_checks():
    t = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "y": np.ones(2, np.float32)}
    data = encode(t, {"learner": 1, "tokens": 64})
    back, meta = decode(data)
    assert meta["learner"] == 1 and meta["tokens"] == 64 and len(meta["sha256"]) == 64
    np.testing.assert_array_equal(back["x"], t["x"])
    with pytest.raises(CorruptObjectError, match="truncated|unreadable"):
        decode(data[: len(data) - 5])
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF  # one bit of the last tensor's bytes
    with pytest.raises(CorruptObjectError, match="checksum"):
        decode(bytes(flipped))
    with pytest.raises(CorruptObjectError):
        decode(b"not an object")


def test_create_refuses_an_existing_exchange_and_open_names_a_missing_one(url, tmp_path):
    make(url)
    with pytest.raises(FileExistsError, match="already exists"):
        make(url)
    with pytest.raises(FileNotFoundError, match="no exchange at"):
        FsspecExchange.open(str(tmp_path / "nowhere"))


# -- submissions: visibility, order, quarantine, GC ----------------------------------------------
def test_submissions_flow_to_the_syncer_in_send_order(url):
    ex = make(url)
    learner, syncer = FsspecExchange.open(url), FsspecExchange.open(url)
    for step in (1, 2, 3):
        learner.submit(sub(0, 1, step, step=step))
    got = syncer.drain()
    assert [s.local_step for s in got] == [1, 2, 3] and all(s.key for s in got)
    np.testing.assert_array_equal(got[2].params["b"], np.full(16, 3, np.float32))
    assert syncer.drain() == []  # drained once
    syncer.discard([s.key for s in got])
    assert ex._ls(ex._p("inbox")) == []


def test_a_reader_never_sees_a_half_written_object(url):
    """A writer thread submits large objects while the syncer drains as fast as it can: every object
    drained is whole (no quarantine) and every one arrives."""
    make(url)
    writer, reader = FsspecExchange.open(url), FsspecExchange.open(url)
    big = {"a": np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)}  # 1 MiB
    n, got = 40, []

    def write():
        for i in range(n):
            writer.submit(
                Submission(learner=0, fragment=0, params=big, tokens=1, steps=1, base_version=0, local_step=i + 1)
            )

    t = threading.Thread(target=write)
    t.start()
    while t.is_alive() or len(got) < n:
        got += reader.drain()
        if not t.is_alive() and len(got) < n:
            got += reader.drain()
            break
    t.join()
    assert reader.take_events() == []
    assert sorted(s.local_step for s in got) == list(range(1, n + 1))
    assert all(np.array_equal(s.params["a"], big["a"]) for s in got)


def test_corrupted_and_truncated_submissions_are_quarantined_not_merged(url):
    ex = make(url, learners=2)
    learner, syncer_ex = FsspecExchange.open(url), FsspecExchange.open(url)
    syncer_ex.take_office()
    learner.submit(sub(0, 0, 1.0, tokens=10))
    learner.submit(sub(1, 0, 3.0, tokens=10))
    good, bad = sorted(ex._ls(ex._p("inbox")))
    data = ex._get(ex._p("inbox", bad))
    ex.fs.pipe_file(ex._p("inbox", bad), data[: len(data) // 2])  # truncated in storage
    extra = "000000000000-l000-f001-a001-s000000009-deadbeef.safetensors"
    flipped = bytearray(encode({"b": np.ones(16, np.float32)}, {"learner": 0}))
    flipped[-1] ^= 1
    ex.fs.pipe_file(ex._p("inbox", extra), bytes(flipped))  # bit flip after the checksum was taken

    s = Syncer(
        {"a": np.zeros((4, 8), np.float32), "b": np.zeros(16, np.float32)},
        [["a"], ["b"]],
        SyncerSettings(num_learners=2, quorum=1, grace_s=0.0, outer_lr=1.0, outer_momentum=0.0),
    )
    events, records = [], []
    syncer_ex.mark_learners_done()
    run_syncer(
        s,
        syncer_ex,
        SyncerHooks(on_merge=records.append, on_event=events.append),
        eval_every_tokens=10**9,
        heartbeat_timeout_s=1.0,
    )
    assert {e["object"] for e in events} == {bad, extra}
    assert {e["learner"] for e in events} == {1, 0} and all(e["event"] == "quarantined" for e in events)
    assert sorted(ex._ls(ex._p("quarantine"))) == sorted([bad, bad + ".reason", extra, extra + ".reason"])
    assert "truncated" in ex._get(ex._p("quarantine", bad + ".reason")).decode()
    # only the good submission was merged: Θ_0 moved to learner 0's copy (outer lr 1, no momentum)
    assert [r["contributors"] for r in records] == [[0]]
    np.testing.assert_allclose(s.global_params[0]["a"], 1.0)
    assert s.versions == [1, 0]
    assert ex._ls(ex._p("inbox")) == []  # merged and quarantined objects gone from the inbox
    assert good not in ex._ls(ex._p("quarantine"))


# -- published fragments, fencing ----------------------------------------------------------------
def test_publish_latest_versions_and_garbage_collection(url):
    ex = make(url)
    syncer = FsspecExchange.open(url)
    assert syncer.take_office() == 1
    reader = FsspecExchange.open(url)
    assert reader.versions() == [0, 0]
    for v in range(1, 5):
        syncer.publish(1, v, {"b": np.full(16, v, np.float32)})
    version, params = reader.latest(1)
    assert version == 4 and params["b"][0] == 4
    assert sorted(ex._ls(ex._p("global", "f001"))) == ["v00000003.safetensors", "v00000004.safetensors"]
    with pytest.raises(ValueError, match="not above the published"):
        syncer.publish(1, 4, {"b": np.zeros(16, np.float32)})  # a repeat


def test_a_stale_syncer_cannot_publish_or_grant(url):
    make(url)
    old, new = FsspecExchange.open(url), FsspecExchange.open(url)
    assert old.take_office() == 1
    old.publish(0, 1, {"a": np.ones((4, 8), np.float32)})
    assert new.take_office() == 2
    with pytest.raises(StaleSyncerError, match="generation 2 has taken office"):
        old.publish(0, 2, {"a": np.full((4, 8), 9, np.float32)})
    with pytest.raises(StaleSyncerError):
        old.close()
    new.publish(0, 2, {"a": np.full((4, 8), 2, np.float32)})
    reader = FsspecExchange.open(url)
    assert reader.latest(0)[0] == 2 and reader.latest(0)[1]["a"][0, 0] == 2
    assert json.loads(reader._get(reader._p("state.json")))["generation"] == 2
    with pytest.raises(RuntimeError, match="take_office"):
        FsspecExchange.open(url).publish(0, 3, {"a": np.zeros((4, 8), np.float32)})


# -- the token budget ----------------------------------------------------------------------------
def test_claims_stay_within_grants_and_grants_within_the_budget(url):
    make(url, learners=2, budget=1000, grant=100)
    syncer, a, b = FsspecExchange.open(url), FsspecExchange.open(url), FsspecExchange.open(url)
    syncer.take_office()
    assert a.claim_tokens(60, learner=0) and not a._read_state(fresh=True)["grants"]["0"] < 100
    stop = threading.Event()
    claimed = {0: 60, 1: 0}

    def learner(ex, m):
        while ex.claim_tokens(10, learner=m, stop=stop.is_set):
            claimed[m] += 10

    threads = [threading.Thread(target=learner, args=(ex, m)) for ex, m in ((a, 0), (b, 1))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        syncer.grant()
        time.sleep(0.001)
    for t in threads:
        t.join()
    syncer.refresh()
    assert claimed[0] + claimed[1] == 1000 == syncer.claimed_tokens  # spent exactly, durably counted
    grants = syncer._read_state(fresh=True)["grants"]
    assert sum(int(g) for g in grants.values()) == 1000


def test_a_counters_only_heartbeat_waits_out_the_quiet_period_a_status_or_claim_never_does(url, monkeypatch):
    """Counters alone are written at most every BEAT_EVERY_S after the learner's last write (each
    claim writes the same file, with them); a status change and a claim are written at once."""
    import diloco.exchange.fsspec as fx

    make(url)
    a, reader = FsspecExchange.open(url), FsspecExchange.open(url)
    writes = []
    real = a._write_beat
    monkeypatch.setattr(a, "_write_beat", lambda m, beat, now: (writes.append(dict(beat)), real(m, beat, now)))
    clock = [100.0]
    monkeypatch.setattr(fx.time, "monotonic", lambda: clock[0])
    a.heartbeat(0, status="running", step=0)
    a.heartbeat(0, step=1)  # counters only, at once: not written
    clock[0] += fx.BEAT_EVERY_S / 2
    a.heartbeat(0, step=2)  # still inside the quiet period (poll_s is 1 ms here)
    assert [w["step"] for w in writes] == [0]
    assert a.claim_tokens(10, learner=0)  # a claim is written whatever the period, with the counters
    assert [w["step"] for w in writes] == [0, 2] and writes[-1]["claimed"] == 10
    clock[0] += fx.BEAT_EVERY_S / 2
    a.heartbeat(0, step=3)  # the claim restarted the quiet period
    clock[0] += fx.BEAT_EVERY_S
    a.heartbeat(0, step=4)
    a.heartbeat(0, status="done", step=5)  # a status is written at once
    assert [w["step"] for w in writes] == [0, 2, 4, 5]
    reader._others_at = -1e18
    assert reader.learners()[0]["step"] == 5 and reader.learners()[0]["status"] == "done"


def test_a_claim_without_a_learner_is_refused(url):
    make(url)
    with pytest.raises(TypeError, match="learner=m"):
        FsspecExchange.open(url).claim_tokens(10)


@pytest.mark.parametrize("store", ["local", "s3"])
def test_racing_processes_never_over_spend_even_when_one_dies_mid_claim(store, tmp_path, request):
    """Three learner processes claim 8 tokens at a time while this process grants; learner 2 is
    SIGKILLed after 40 tokens and a new process of it carries on from its durable claims (on a local
    folder, and on an S3 endpoint whose credentials the spawned processes take from the environment)."""
    if store == "s3":
        request.getfixturevalue("s3_env")
        url = f"s3://{S3_BUCKET}/ex-{uuid.uuid4().hex}"
    else:
        url = str(tmp_path / "exchange")
    make(url, learners=3, budget=2000, grant=64)
    syncer = FsspecExchange.open(url, poll_s=0.001)
    syncer.take_office()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=claim_until_refused, args=(url, m, 40 if m == 2 else None, out)) for m in range(3)]
    for p in procs:
        p.start()
    while procs[2].is_alive():
        syncer.grant()
        time.sleep(0.002)
    assert procs[2].exitcode == -9  # SIGKILL
    retry = ctx.Process(target=claim_until_refused, args=(url, 2, None, out))
    retry.start()
    while any(p.is_alive() for p in (*procs[:2], retry)):
        syncer.grant()
        time.sleep(0.002)
    for p in (*procs, retry):
        p.join()
    syncer.refresh()
    counts = dict(out.get(timeout=10) for _ in range(3))
    durable = {m: v["claimed"] for m, v in syncer.learners().items()}
    assert counts[0] == durable[0] and counts[1] == durable[1]
    assert durable[2] == 40 + counts[2]  # the retry continued from the killed process's durable claims
    assert sum(durable.values()) == 2000  # the whole budget, and not one token more


# -- URL forms, half-written objects, unwritable URLs (issue 25, part 6) -------------------------
def _round_trip(url):
    """Create at ``url``, open a second handle, submit, drain, publish and read back: the exchange works."""
    ex = make(url)
    learner, syncer = FsspecExchange.open(url), FsspecExchange.open(url)
    learner.submit(sub(0, 1, 3.0))
    got = syncer.drain()
    assert [s.local_step for s in got] == [1]
    np.testing.assert_array_equal(got[0].params["b"], np.full(16, 3.0, np.float32))
    syncer.take_office()
    syncer.publish(1, 1, {"b": np.full(16, 2.0, np.float32)})
    learner.refresh()
    version, params = learner.latest(1)
    assert version == 1 and params["b"][0] == 2.0
    return ex


def test_url_forms_fsspec_documents_work_or_are_refused_naming_the_form(tmp_path, monkeypatch):
    """Local paths (absolute, relative, ``~``), ``file://``, ``local://`` and ``memory://`` work; chained
    URLs are refused naming the layer: a caching layer serves stale copies of the objects the exchange
    rewrites (``state.json``, the heartbeats), an archive is read-only."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for url in (
        str(tmp_path / "plain"),
        f"file://{tmp_path}/fileurl",
        f"local://{tmp_path}/localurl",
        f"memory://ex-{uuid.uuid4().hex}",
        "rel/ex",
        "./rel2",
        "~/tilde",
    ):
        ex = _round_trip(url)
        if not url.startswith("memory://"):
            expected = {
                "rel/ex": tmp_path / "rel" / "ex",
                "./rel2": tmp_path / "rel2",
                "~/tilde": tmp_path / "home" / "tilde",
            }.get(url)
            assert expected is None or ex.root == str(expected), url
            assert (Path(ex.root) / "meta.json").is_file(), url
    for url, needle in (
        (f"simplecache::file://{tmp_path}/sc", "simplecache::"),
        (f"blockcache::file://{tmp_path}/bc", "blockcache::"),
        (f"filecache::memory://x-{uuid.uuid4().hex}", "filecache::"),
        (f"zip://inner::file://{tmp_path}/a.zip", "zip://"),
    ):
        with pytest.raises(ValueError, match=re.escape(needle)) as info:
            make(url)
        assert "chained" in str(info.value)
        with pytest.raises(ValueError, match="chained"):
            FsspecExchange.open(url)
    assert not (tmp_path / "sc").exists() and not (tmp_path / "bc").exists()


def test_a_relative_exchange_url_means_the_same_folder_in_every_process(tmp_path, monkeypatch):
    """``runtime.exchange_url`` relative or with ``~``: the run's exchange URL is made absolute once, in
    the process that resolves it (worker processes may start elsewhere)."""
    from configs.load import load_config
    from training.decoupled.setup import exchange_url, with_absolute_exchange

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = Path(__file__).resolve().parents[1]
    for given, expected in (
        ("rel/ex", tmp_path / "rel" / "ex"),
        ("~/ex", tmp_path / "home" / "ex"),
        (f"file://{tmp_path}/f", None),
        ("memory://m", None),
    ):
        cfg = load_config(root / "configs" / "tiny.yaml", {"runtime.exchange_url": given})
        got = exchange_url(cfg.runtime, tmp_path / "runs" / "R")
        assert got == (str(expected / "R") if expected else f"{given}/R"), given
        fixed = with_absolute_exchange(cfg)  # what the flow hands its tasks
        assert fixed.runtime.exchange_url == (str(expected) if expected else given)
        monkeypatch.chdir(tmp_path / "runs" if (tmp_path / "runs").is_dir() else tmp_path.parent)  # a worker elsewhere
        assert exchange_url(fixed.runtime, tmp_path / "runs" / "R") == got, given
        monkeypatch.chdir(tmp_path)


class _FailingFile:
    """A file that takes half of what is written to it, then fails as a full disk does."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(bytes(data)[: len(data) // 2])
        self.f.flush()
        raise OSError(28, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def close(self):
        self.f.close()


def test_a_write_that_fails_half_way_leaves_no_temporary_object(tmp_path, monkeypatch):
    """A submission whose write fails half-way (a full disk) raises, and leaves neither a visible
    object nor a temporary one; the next write works."""
    url = str(tmp_path / "exchange")
    make(url)
    learner, syncer = FsspecExchange.open(url), FsspecExchange.open(url)
    real_open = learner.fs.open
    monkeypatch.setattr(
        learner.fs,
        "open",
        lambda path, mode="rb", **kw: (
            _FailingFile(real_open(path, mode, **kw)) if "w" in mode else real_open(path, mode, **kw)
        ),
    )
    with pytest.raises(OSError, match="No space left"):
        learner.submit(sub(0, 1, 1.0))
    monkeypatch.undo()
    assert learner._ls(learner._p("tmp")) == [] and learner._ls(learner._p("inbox")) == []
    assert syncer.drain() == [] and syncer.take_events() == []
    learner.submit(sub(0, 1, 2.0, step=2))
    assert [s.local_step for s in syncer.drain()] == [2]
    assert learner._ls(learner._p("tmp")) == []


def test_the_next_start_removes_temporary_objects_of_dead_writers(tmp_path):
    """A writer killed mid-write (SIGKILL, out of memory) leaves its ``tmp/*.part``: the next process
    that opens the exchange removes those of writers on this host that are gone, and keeps those of
    live writers and of other hosts (whose processes it cannot see)."""
    import socket
    import subprocess
    import sys

    url = str(tmp_path / "exchange")
    ex = make(url)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tmp = Path(ex.root) / "tmp"
    host = socket.gethostname()
    names = {
        "dead": f"{host}-{dead.pid}-{uuid.uuid4().hex}.part",
        "live": f"{host}-{os.getpid()}-{uuid.uuid4().hex}.part",
        "other": f"elsewhere-{dead.pid}-{uuid.uuid4().hex}.part",
    }
    for name in names.values():
        (tmp / name).write_bytes(b"half an object")
    FsspecExchange.open(url)
    assert sorted(p.name for p in tmp.iterdir()) == sorted([names["live"], names["other"]])


@pytest.mark.process
@pytest.mark.slow
def test_an_exchange_url_that_cannot_be_written_is_refused_before_prefect_starts(tmp_path):
    """``runtime.exchange_url`` below a file, or a chained caching URL: one line naming the field and
    the fix, exit 2, before Prefect starts, and no run directory. (In fresh processes: the CLI's
    logging set-up inside pytest's capture closed pytest's captured stderr here.)"""
    from tests.test_refusals import cli_process, one_line_refusal

    (tmp_path / "afile").write_text("not a folder")
    rd = tmp_path / "R"
    line = one_line_refusal(
        *cli_process("run", "tiny", "--run-dir", rd, "--set", f"runtime.exchange_url={tmp_path / 'afile' / 'ex'}")
    )
    assert "runtime.exchange_url" in line and "cannot be created or written" in line, line
    assert not rd.exists()
    line = one_line_refusal(
        *cli_process("run", "tiny", "--run-dir", rd, "--set", f"runtime.exchange_url=simplecache::file://{tmp_path}/ex")
    )
    assert "runtime.exchange_url" in line and "simplecache::" in line, line
    assert not rd.exists() and not (tmp_path / "ex").exists()


def test_the_exchange_url_check_leaves_nothing_behind(tmp_path):
    """A writable ``runtime.exchange_url`` passes the check, which leaves no probe object and no
    folder it created (the URL may lie in a run directory that must stay empty until the run)."""
    from configs.load import load_config
    from flows.preflight import check_runtime

    root = Path(__file__).resolve().parents[1]
    check_runtime(
        load_config(root / "configs" / "tiny.yaml", {"runtime.exchange_url": str(tmp_path / "new" / "ex")}).runtime
    )
    assert not (tmp_path / "new").exists()


def test_the_writability_check_removes_only_its_own_empty_folders(tmp_path, monkeypatch):
    """``check_writable`` on a new nested root makes the folders, probes and removes them again; when
    another run starts writing in one of them meanwhile (two sweep cells checking the same new
    exchange URL), that folder and its file stay."""
    import fsspec.implementations.local as local

    from diloco.exchange.fsspec import check_writable

    check_writable(str(tmp_path / "a" / "b" / "c"))
    assert list(tmp_path.iterdir()) == []
    pipe = local.LocalFileSystem.pipe_file

    def pipe_and_race(self, path, value, **kw):  # another run's exchange appears under a/b meanwhile
        (tmp_path / "a" / "b" / "other").mkdir(exist_ok=True)
        (tmp_path / "a" / "b" / "other" / "meta.json").write_text("{}")
        return pipe(self, path, value, **kw)

    monkeypatch.setattr(local.LocalFileSystem, "pipe_file", pipe_and_race)
    check_writable(str(tmp_path / "a" / "b" / "c"))
    assert (tmp_path / "a" / "b" / "other" / "meta.json").read_text() == "{}"
    assert not (tmp_path / "a" / "b" / "c").exists()


def test_a_cache_folder_that_cannot_be_written_is_refused_before_work_naming_the_field(tmp_path):
    from configs.specs import load_spec
    from flows.preflight import check_runtime

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cfg = load_spec(
        "config",
        Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
        {"runtime.compilation_cache": str(blocker / "xla")},
    )
    with pytest.raises(ValueError, match=r"runtime\.compilation_cache .*: cannot be created or written here"):
        check_runtime(cfg.runtime)
    fine = load_spec(
        "config",
        Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml",
        {"runtime.compilation_cache": str(tmp_path / "new" / "xla")},
    )
    check_runtime(fine.runtime)
    assert not (tmp_path / "new").exists()  # the check leaves nothing of its own


# -- an S3 endpoint's credentials (issue 30) ------------------------------------------------------
def test_an_s3_exchange_with_missing_or_wrong_credentials_is_one_line_before_work(s3_env, monkeypatch):
    """Credentials come from the environment only: none, a wrong secret, an unknown key or a bucket
    that does not exist each give one line naming ``runtime.exchange_url``, where credentials come
    from and the fix; no secret appears in it, and no bucket is created."""
    import s3fs

    from configs.load import load_config
    from flows.preflight import check_runtime

    root = Path(__file__).resolve().parents[1]

    def refusal(url: str) -> str:
        with pytest.raises(ValueError) as info:
            check_runtime(load_config(root / "configs" / "tiny.yaml", {"runtime.exchange_url": url}).runtime)
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith(f"runtime.exchange_url {url}: ")
        assert s3_env["AWS_SECRET_ACCESS_KEY"] not in msg and "wrong-secret" not in msg
        return msg

    good = f"s3://{S3_BUCKET}/ex-{uuid.uuid4().hex}"
    check_runtime(load_config(root / "configs" / "tiny.yaml", {"runtime.exchange_url": good}).runtime)  # passes
    assert "bucket does not exist" in refusal("s3://no-such-bucket/ex").lower()
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    assert not fs.exists("no-such-bucket")  # the check never creates a bucket

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    msg = refusal(good)
    assert "signature" in msg and "AWS_SECRET_ACCESS_KEY" in msg
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000")
    assert "Access Key Id" in refusal(good)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # (no instance metadata to ask here)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    assert "Unable to locate credentials" in refusal(good)
