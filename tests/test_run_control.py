"""How a run ends: a stop signal stops it cleanly, and a run that lost most of its work fails.

Both are real pipeline runs on the tiny config and the committed small corpus (a subprocess for
the signal, the session's Prefect harness for the failed run).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from run.layout import RunLayout
from tests.conftest import SMALL_CORPUS, SMALL_DATA
from training.decoupled.syncer import work_lost

ROOT = Path(__file__).resolve().parents[1]


def _diloco_trains(run_dir: Path) -> bool:
    """True once a learner of the run in ``run_dir`` has logged a training step (its first logged
    step comes within a second or two of DiLoCo's start; the flow's first progress line only after
    10 s)."""
    path = RunLayout(run_dir).metrics("pretrain", "diloco", "learners")
    if not path.is_file():
        return False
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("event") == "step":
                return True
        except json.JSONDecodeError:  # a line still being written
            pass
    return False


def test_work_lost_thresholds():
    ledger = {
        "0": {"processed": 1000, "dropped": 30, "drop_reasons": {"stale": 30}},
        "1": {"processed": 1000, "dropped": 90, "drop_reasons": {"stale": 40, "non-finite": 50}},
    }
    lost = work_lost(ledger, warn_above=0.05, fail_above=0.5)
    assert lost["processed_tokens"] == 2000 and lost["dropped_tokens"] == 120
    assert lost["dropped_fraction"] == pytest.approx(0.06)
    assert lost["reasons"] == {"stale": 70, "non-finite": 50}
    assert lost["status"] == "warning"
    assert work_lost(ledger, 0.1, 0.5)["status"] == "ok"
    assert work_lost(ledger, 0.01, 0.05)["status"] == "failed"
    assert work_lost({"0": {"processed": 0, "dropped": 0}}, 0.05, 0.5)["dropped_fraction"] == 0.0


@pytest.mark.slow
def test_a_run_that_mostly_failed_fails(prefect_harness, small_data, tmp_path):
    """Learners that diverge (inner lr 50) have most submissions dropped as non-finite: the run
    writes its report, says so at the top, records ``failed`` and ends Failed (exit 1 in the CLI)."""
    import shutil

    from prefect.exceptions import FailedRun

    from flows.pipeline import pipeline

    rd = tmp_path / "run"
    shutil.copytree(small_data, rd)  # the data is reused: it was built from the same data config
    layout = RunLayout(rd)
    with pytest.raises(FailedRun, match=r"the syncer dropped \d+\.\d % .*non-finite.*max_dropped_fraction = 0.5"):
        pipeline(
            config_file="tiny",
            run_dir=str(rd),
            overrides={
                **SMALL_DATA,
                "diloco.inner.lr": 50.0,
                "dp.enabled": False,
                "eval.enabled": False,
                "finetune.enabled": False,
            },
        )
    status = json.loads(layout.status.read_text())
    assert status["status"] == "failed" and status["completed_stages"] == ["data", "pretrain-diloco", "report"]
    lost = json.loads(layout.summary("pretrain", "diloco").read_text())["work_lost"]
    assert lost["status"] == "failed" and lost["dropped_fraction"] > 0.5
    assert lost["reasons"]["non-finite"] > 0.5 * lost["processed_tokens"]  # (a few may go as superseded)
    head = layout.report_md.read_text().split("\n## ")[0]  # above the first section
    failed = next(ln for ln in head.splitlines() if ln.startswith("**Failed:"))
    warning = next(ln for ln in head.splitlines() if ln.startswith("**Warning:"))
    assert "max_dropped_fraction = 0.5" in failed
    assert "non-finite" in warning and "max_dropped_fraction = 0.5" in warning


@pytest.mark.process
@pytest.mark.slow
def test_ctrl_c_stops_a_run_cleanly(tmp_path):
    """Ctrl-C in a terminal (SIGINT to the run's whole process group) during DiLoCo training:
    learners stop at the next step, the syncer saves its state, the report of what was done is
    written, status.json says ``interrupted``, the exit is 130, and Prefect's temporary server,
    which the signal must not reach (flows/server.py), is stopped with the run."""
    import psutil

    rd = tmp_path / "R"
    log = tmp_path / "out.log"
    # far more than is trained before the signal: the jitted step runs 98,304 tokens of the tiny
    # config in about 9 s on 2 CPU cores
    budget = 393216
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "run",
                "tiny",
                "--run-dir",
                str(rd),
                "--set",
                f"train.token_budget={budget}",
                "--set",
                "data.source=local",
                "--set",
                f"data.paths=[{SMALL_CORPUS}]",
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PREFECT_LOGGING_LEVEL": "INFO"},
            start_new_session=True,
        )  # a process group of its own, as a terminal's job
    try:
        deadline = time.monotonic() + 240
        while not _diloco_trains(rd):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        servers = [c for c in psutil.Process(proc.pid).children() if "uvicorn" in " ".join(c.cmdline())]
        assert len(servers) == 1 and os.getpgid(servers[0].pid) != proc.pid  # its own session
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C
        sent = time.monotonic()
        code = proc.wait(timeout=120)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 130, text[-3000:]
    assert "SIGINT received: stopping at the next step boundary" in text
    assert "Traceback" not in text, text[-3000:]
    assert "os.fork() was called" not in text  # (JAX's warning: the server must not be forked with a hook)
    assert "Stopping temporary server" not in text  # the last line is ours: why the run stopped
    assert text.strip().splitlines()[-1].startswith("interrupted: "), text[-1000:]
    layout = RunLayout(rd)
    status = json.loads(layout.status.read_text())
    assert status["status"] == "interrupted" and status["reason"] == "SIGINT received"
    assert status["completed_stages"] == ["data", "report"]  # DiLoCo stopped part-way; DP never started
    summary = json.loads(layout.summary("pretrain", "diloco").read_text())
    assert summary["interrupted"] and 0 < summary["tokens"] < budget
    assert any(layout.checkpoints("pretrain", "diloco").iterdir())  # the syncer saved Θ and its outer state
    assert not layout.method_dir("pretrain", "dp").exists()
    assert layout.report_md.is_file()
    assert took < 60, f"stopping took {took:.1f} s"
    psutil.wait_procs(servers, timeout=10)
    assert not servers[0].is_running(), "Prefect's temporary server outlived the run"


def test_sigterm_inside_graceful_stop_asks_for_a_stop_and_a_second_falls_through():
    """What a scheduler's preemption (SIGTERM to the process) does: the first signal only sets the
    stop flag and records its number (the CLI's exit is 128 + 15); the same signal again at once is
    that stop delivered twice and is ignored; the handler before is back after the block; a second
    signal inside it, later, reaches that handler (here: one that records it)."""
    from run import control

    seen = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    control.reset()
    try:
        with control.graceful_stop():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # (Python runs the handler between bytecodes of the main thread)
            assert control.stop_requested() and control.stop_signal() == signal.SIGTERM and seen == []
            os.kill(os.getpid(), signal.SIGTERM)  # the same stop delivered twice at once (`timeout` does)
            time.sleep(0.05)
            assert seen == []
            time.sleep(control.REPEAT_S)
            os.kill(os.getpid(), signal.SIGTERM)  # later: the user insists
            time.sleep(0.05)
            assert seen == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        control.reset()
        signal.signal(signal.SIGTERM, before)


def test_the_local_dask_cluster_preloads_the_sigint_shield_and_it_absorbs_ctrl_c():
    """Ctrl-C on a Dask run: the local cluster's worker processes (in the terminal's process group)
    preload ``run.control``, whose ``dask_setup`` makes SIGINT do nothing there (here: in this
    process, where it would otherwise raise KeyboardInterrupt); the stop reaches their learners
    through the exchange. The whole stop on Dask was measured by hand (README: 14 s, exit 130)."""
    from configs.load import load_config
    from flows.engines import task_runner_for
    from run import control

    runner = task_runner_for(load_config(ROOT / "configs" / "tiny.yaml", {"runtime.engine": "dask"}))
    assert "run.control" in runner.cluster_kwargs["preload"]
    before = signal.getsignal(signal.SIGINT)
    try:
        control.dask_setup(worker=None)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # a KeyboardInterrupt would have been raised here
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.cluster
@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["dask", "ray"])
def test_a_run_killed_with_sigkill_leaves_nothing_running(tmp_path, engine):
    """``kill -9`` of ``ddiloco`` mid-run (what a time-out or the out-of-memory killer does: no exit
    handler runs): everything the run started ends with it: Prefect's temporary server (its own
    session: flows/server.py) and, on Dask, the local cluster's worker processes, on Ray the local
    instance (GCS, raylet, its workers). Only the CLI's process is killed, not its group. (On the
    thread engine the server is all there is to end: the next test kills its parent directly.)"""
    import psutil

    rd = tmp_path / "R"
    log = tmp_path / "out.log"
    budget = 393216  # far more than is trained before the kill
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "run",
                "tiny",
                "--run-dir",
                str(rd),
                "--set",
                f"train.token_budget={budget}",
                "--set",
                "data.source=local",
                "--set",
                f"data.paths=[{SMALL_CORPUS}]",
                "--set",
                f"runtime.engine={engine}",
                "--set",
                "diloco.learners=2",
                "--set",
                "diloco.quorum=1",
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PREFECT_LOGGING_LEVEL": "INFO"},
            start_new_session=True,
        )
    # the local cluster's worker processes (2 learners and the syncer): Dask's spawned workers, Ray's
    # task workers (their process title: ray::<task>)
    worker_mark = {"dask": "multiprocessing.spawn", "ray": "ray::"}.get(engine)
    workers = 3 if worker_mark else 0

    def descendants():
        return [(p, " ".join(p.cmdline())) for p in psutil.Process(proc.pid).children(recursive=True)]

    started: list = []
    try:
        deadline = time.monotonic() + 600
        # DiLoCo under way: a learner has logged a step, and on Dask and Ray the cluster's workers started
        while not _diloco_trains(rd) or (
            worker_mark is not None and sum(worker_mark in n for _, n in descendants()) < workers
        ):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        started = [p for p, _ in descendants()]
        assert any("uvicorn" in n for _, n in descendants()), descendants()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(started, timeout=60)
        left = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in started:  # never leave this test's processes behind, whatever happened
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    assert not left, f"left running after the run's process was killed: {left}"


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("with_setpriv", [True, False])
def test_the_temporary_servers_process_ends_when_its_parent_is_killed(tmp_path, with_setpriv):
    """The server's start (flows/server.py) on a tiny ASGI app instead of Prefect's: a parent process
    starts it and is SIGKILLed; the server ends, through ``setpriv --pdeathsig`` where util-linux has
    it and through the watchdog thread alone where it does not (``setpriv`` treated as missing)."""
    import socket

    import psutil

    from flows.server import setpriv

    if with_setpriv and setpriv() is None:
        pytest.skip("util-linux's setpriv with --pdeathsig is not installed here")
    (tmp_path / "app.py").write_text(
        "async def app(scope, receive, send):\n"
        "    if scope['type'] == 'http':\n"
        "        await send({'type': 'http.response.start', 'status': 200, 'headers': []})\n"
        "        await send({'type': 'http.response.body', 'body': b'ok'})\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time\n"
                "import flows.server as server\n"
                f"if not {with_setpriv}: server.setpriv = lambda: None\n"
                "child = server.start_server_process("
                f"[sys.executable, '-m', 'uvicorn', '--app-dir', {str(tmp_path)!r}, "
                f"'app:app', '--port', '{port}', '--log-level', 'error'])\n"
                "print(child.pid, ' '.join(child.args[:4]), flush=True)\n"
                "time.sleep(600)\n"
            ),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    server = None
    try:
        pid, command = parent.stdout.readline().split(" ", 1)
        server = psutil.Process(int(pid))
        assert ("setpriv" in command) == with_setpriv, command
        deadline = time.monotonic() + 120
        while True:  # serving
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.is_running() and time.monotonic() < deadline
                time.sleep(0.2)
        assert os.getsid(server.pid) != os.getsid(parent.pid)  # a session of its own
        parent.kill()
        parent.wait(timeout=30)
        _, alive = psutil.wait_procs([server], timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
        if server is not None and server.is_running():
            server.kill()
    assert not alive, "the server outlived the process that started it"
