"""`make ui` (`ddiloco ui`, flows/ui_stack.py): the server, the work pool, every deployment of
prefect.yaml and a worker come up together, and one Ctrl-C takes them all down."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DDILOCO = str(Path(sys.executable).with_name("ddiloco"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_taken_port_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(
            [DDILOCO, "ui", "--port", str(port), "--log-dir", str(tmp_path / "logs")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2, out
    assert f"127.0.0.1:{port} is taken" in out.stderr and "UI_PORT=" in out.stderr
    assert not (tmp_path / "logs").exists()  # nothing started, nothing written


def test_a_bad_host_port_or_log_folder_is_refused_in_one_line(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    for args, phrase in (
        (["--port", "70000"], "--port 70000: give a port between 1 and 65535"),
        (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: not an address"),
        (["--log-dir", str(tmp_path / "a-file")], "is a file, not a folder"),
    ):
        out = subprocess.run([DDILOCO, "ui", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and phrase in out.stderr and "Traceback" not in out.stderr, (args, out)
    assert (tmp_path / "a-file").read_text() == "not a folder"


def _ours(home: Path) -> list:
    """Processes whose environment has this test's PREFECT_HOME: the stack's children."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("PREFECT_HOME") == str(home) and p.pid != os.getpid():
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.mark.process
def test_make_ui_brings_the_whole_stack_up_and_one_ctrl_c_takes_it_down(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    port, home = _free_port(), tmp_path / "prefect-home"
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    env["PREFECT_API_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}"
    out = tmp_path / "stack.out"
    with open(out, "wb") as fh:
        stack = subprocess.Popen(
            [DDILOCO, "ui", "--port", str(port), "--log-dir", str(tmp_path / "logs")],
            cwd=REPO,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        end = time.monotonic() + 300
        while "ready: open" not in out.read_text():
            assert stack.poll() is None and time.monotonic() < end, out.read_text()
            time.sleep(1)
        shipped = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            deployments = client.read_deployments()
            assert len(deployments) == len(shipped)  # every deployment of prefect.yaml
            assert {"pipeline", "tiny"} <= set(next(d for d in deployments if d.name == "tiny").tags)
            assert client.read_work_pool("local-proc").type == "process"
            end = time.monotonic() + 60
            while not client.read_workers_for_work_pool("local-proc"):  # the worker's first poll
                assert time.monotonic() < end, out.read_text()
                time.sleep(1)
        assert _ours(home), "the stack's server and worker run with its PREFECT_HOME"
        stack.send_signal(signal.SIGINT)  # what Ctrl-C in its terminal sends
        assert stack.wait(timeout=90) == 0, out.read_text()
        text = out.read_text()
        assert "stopped the worker" in text and "stopped the server" in text
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert not _ours(home), "a process of the stack outlived it"
    finally:
        if stack.poll() is None:
            os.killpg(stack.pid, signal.SIGKILL)
        for p in _ours(home):
            p.kill()
