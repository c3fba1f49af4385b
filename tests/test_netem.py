"""Emulated datacenters (``network.emulate``, ``run.netem``): links shaped to their rate, a tiny run
whose learners and DP hosts each train in a namespace of their own, nothing left behind after a
``kill -9``, and a refusal where the machine cannot emulate (not root).

Needs root, iproute2 and util-linux (as on these machines and in CI); elsewhere the tests that make
namespaces are skipped with the reason."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from run.layout import RunLayout
from run.metrics import read_jsonl
from run.netem import datacenters, emulation_problem, leftovers
from tests.conftest import SMALL_CORPUS

ROOT = Path(__file__).resolve().parents[1]
needs_namespaces = pytest.mark.skipif(emulation_problem() is not None, reason=str(emulation_problem()))


FLOOD = (
    "import socket, sys, time; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); b = b'x' * 1400; "
    "end = time.monotonic() + float(sys.argv[3])\n"
    "while time.monotonic() < end:\n"
    "    try: s.sendto(b, (sys.argv[1], int(sys.argv[2])))\n"
    "    except OSError: pass\n"
)


def _rate(read, flood: list[str], window_s: float = 2.0) -> float:
    """Bits per second a link let through while ``flood`` (a command offering far more) ran: the
    kernel's byte counter on the link (``read()``) sampled once the flood is under way and
    ``window_s`` later, so neither process start-up nor a slow receiver on a loaded machine counts."""
    proc = subprocess.Popen(flood)
    try:
        time.sleep(0.5)
        b0, t0 = read(), time.monotonic()
        time.sleep(window_s)
        b1, t1 = read(), time.monotonic()
    finally:
        proc.wait(timeout=30)
    return (b1 - b0) * 8 / (t1 - t0)


@needs_namespaces
def test_a_shaped_link_carries_its_rate_each_way_and_counts_its_bytes():
    """A 20 Mbit/s link flooded with UDP from the datacenter to the hub, then back: what the kernel
    counts crossing it (Ethernet frames) flows at 20 Mbit/s within 10 % each way, however much more
    is offered. Everything made is gone afterwards."""
    with datacenters(1, 0.02) as dcs:
        up = _rate(
            lambda: dcs.link_bytes()[0]["sent"], dcs.wrap(0, [sys.executable, "-c", FLOOD, dcs.hub, "5301", "3"])
        )
        down = _rate(
            lambda: dcs.link_bytes()[0]["received"], [sys.executable, "-c", FLOOD, dcs.addresses[0], "5302", "3"]
        )
        tag = dcs.tag
    assert up == pytest.approx(20e6, rel=0.10) and down == pytest.approx(20e6, rel=0.10), (up, down)
    assert leftovers(tag) == []


def test_emulation_without_root_is_refused_in_one_line_before_work(tmp_path):
    """``ddiloco run`` with ``network.emulate`` as a user who is not root: one line naming
    network.emulate and the fix, exit 2, no run directory (the check runs before any work)."""
    rd = tmp_path / "R"
    cli = "import os, sys; os.geteuid = lambda: 1000; from flows.cli import main; sys.exit(main())"
    args = ["run", "tiny", "--run-dir", str(rd), "--set", "data.source=local", "--set", f"data.paths=[{SMALL_CORPUS}]"]
    args += ["--set", "network.emulate=true", "--set", "dp.hosts=3"]
    out = subprocess.run(
        [sys.executable, "-c", cli, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "network.emulate needs root" in lines[0], lines
    assert "Traceback" not in out.stdout + out.stderr and not rd.exists()


def _cli(rd: Path, *sets: str, budget: int = 12288) -> list[str]:
    base = ["data.source=local", f"data.paths=[{SMALL_CORPUS}]", "network.emulate=true", "network.bandwidth_gbps=0.2"]
    base += ["diloco.learners=2", "diloco.quorum=1", "dp.hosts=2", "dp.workers=2", "eval.enabled=false"]
    base += ["finetune.enabled=false", f"train.token_budget={budget}", "train.eval_every_tokens=6144", *sets]
    return [
        sys.executable,
        "-m",
        "flows.cli",
        "run",
        "tiny",
        "--run-dir",
        str(rd),
        *[a for s in base for a in ("--set", s)],
    ]


@needs_namespaces
@pytest.mark.slow
@pytest.mark.process
def test_a_tiny_run_trains_each_learner_and_dp_host_in_a_datacenter_of_its_own(tmp_path):
    """The tiny pipeline with ``network.emulate`` at 200 Mbit/s: 2 learners and 2 DP hosts, each a
    process in its own namespace (a learner's start event carries its host name, its datacenter's
    address), the syncer and the S3 store in the hub; the run completes, and each stage records the
    bytes its links carried (DP's all-reduce: at least the ring's 2(W−1)/W of the gradient a host a
    step) beside its own count. Nothing is left afterwards."""
    rd = tmp_path / "R"
    out = subprocess.run(_cli(rd), cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    layout = RunLayout(rd)
    nets = {m: json.loads((Path(layout.network("pretrain", m)) / "network.json").read_text()) for m in ("diloco", "dp")}
    starts = [e for e in read_jsonl(layout.metrics("pretrain", "diloco", "learners")) if e["event"] == "start"]
    assert {e["host"] for e in starts} == set(nets["diloco"]["addresses"])  # each learner in its datacenter
    for m, net in nets.items():
        assert net["bandwidth_gbps"] == 0.2 and len(net["links"]) == 2 and "not emulated" in net["latency"]
        assert all(x["sent"] > 0 and x["received"] > 0 for x in net["links"]), (m, net)
        summary = json.loads(layout.summary("pretrain", m).read_text())
        assert summary["network"] == net
    dp = json.loads(layout.summary("pretrain", "dp").read_text())
    ring = 2 * (2 - 1) / 2 * 4 * dp["params"] * dp["steps"]  # bytes each host sends in the all-reduces
    assert all(x["sent"] >= ring for x in nets["dp"]["links"])
    diloco = json.loads(layout.summary("pretrain", "diloco").read_text())
    assert nets["diloco"]["sent_bytes"] >= diloco["bytes_to_syncer"]  # the fragments crossed the links
    assert leftovers() == []


@needs_namespaces
@pytest.mark.slow
@pytest.mark.process
def test_a_sigkilled_emulated_run_leaves_no_namespace_link_or_process(tmp_path):
    """``kill -9`` of an emulated ``ddiloco run`` once its learners train in their datacenters: the
    reaper removes the namespaces, links and bridge, and every process the run started (learner
    processes, the S3 store, Prefect's server) ends with it."""
    rd = tmp_path / "R"
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _cli(rd, budget=393216),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    started: list = []
    try:
        deadline = time.monotonic() + 300
        steps = RunLayout(rd).metrics("pretrain", "diloco", "learners")
        while not (steps.is_file() and '"event": "step"' in steps.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert leftovers() != []
        started = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(started, timeout=60)
        deadline = time.monotonic() + 30
        while leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in started:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    assert not left, f"left running after the run's process was killed: {left}"
    assert leftovers() == []
