"""The pipeline flow through the standard routes besides a direct call (tests/test_flows.py):
``flow.serve()`` + ``run_deployment`` (from a sweep with ``launch: deployment``), and prefect.yaml
(``prefect deploy --all``; a process worker on it runs pipeline/tiny from the UI form in
tests/test_ui_browser.py); prefect.yaml in sync with configs/*.yaml; the UI forms (parameter schemas).

The route test runs the real flow on the tiny config and the committed small corpus, cut to one
eval interval (about 40 s on 2 CPU cores). Servers and workers run in their own process group
against the session's Prefect test server (127.0.0.1) and are always stopped.
"""

import asyncio
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import yaml

from flows.ui_stack import stop_group
from run.layout import RunLayout
from tests.conftest import SMALL_DATA

REPO = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).with_name("prefect"))
# The tiny config on the committed small corpus, one DiLoCo eval interval, no lm-eval, no DP and no
# post-training: shard → DiLoCo → report.
FAST = {
    **SMALL_DATA,
    "train.token_budget": 3072,
    "train.eval_every_tokens": 3072,
    "eval.enabled": False,
    "dp.enabled": False,
    "finetune.enabled": False,
}
RUN_TIMEOUT_S = 240


# ---------------------------------------------------------------------------------------------
# prefect.yaml is generated from the shipped configs


def test_prefect_yaml_in_sync_with_configs():
    from configs.load import load_config
    from flows.deployments import PREFECT_YAML, problems

    assert problems() == [], "prefect.yaml is out of date; run `python -m flows.deployments`"
    deps = {d["name"]: d for d in yaml.safe_load(PREFECT_YAML.read_text())["deployments"]}
    shipped = sorted(p for p in (REPO / "configs").glob("*.yaml"))
    assert {p.stem for p in shipped} >= {"default", "tiny", "failure"}
    for path in shipped:
        dep = deps[path.stem]
        assert dep["entrypoint"] == "flows/pipeline.py:pipeline"
        assert dep["parameters"] == {"config": load_config(path).model_dump(mode="json")}, path.name
        for word in (f"configs/{path.name}", "config_file", "overrides"):
            assert word in dep["description"], (path.stem, word)
    assert deps["default"]["parameters"]["config"]["diloco"]["sync_every"] == 8  # not the schema's 32
    for name, entrypoint in [
        ("pretrain-diloco", "flows/pretrain.py:pretrain_diloco"),
        ("pretrain-dp", "flows/pretrain.py:pretrain_dp"),
        ("goodput", "flows/goodput.py:goodput"),
    ]:
        assert deps[name]["entrypoint"] == entrypoint
    # every deployment runs on the process pool, its flow runs without progress bars (as ddiloco's)
    pool = {"name": "local-proc", "job_variables": {"env": {"TQDM_DISABLE": "1"}}}
    assert all(d["work_pool"] == pool for d in deps.values())
    assert {"pipeline", "tiny"} <= set(deps["tiny"]["tags"]) and "sweep" in deps["nightly"]["tags"]
    # one sweep deployment per shipped sweep, its form pre-filled with the file's spec; the nightly
    # one carries a schedule, inactive as shipped
    from configs.specs import load_spec
    from configs.sweep import shipped_sweeps

    for path in shipped_sweeps():
        dep = deps[path.stem]
        assert dep["entrypoint"] == "flows/sweep.py:sweep"
        assert dep["parameters"] == {"spec": load_spec("sweep", path).model_dump(mode="json")}, path.name
    assert deps["nightly"]["schedules"] == [{"cron": "0 3 * * *", "timezone": "UTC", "active": False}]
    assert "schedules" not in deps["tiny_grid"]
    # one tune deployment per shipped study, its form pre-filled with the file's spec
    from configs.specs import load_spec
    from configs.tune import STUDY_DIR

    studies = sorted(STUDY_DIR.glob("*.yaml"))
    assert studies
    for path in studies:
        dep = deps[path.stem]
        assert dep["entrypoint"] == "flows/tune.py:tune"
        assert dep["parameters"] == {"spec": load_spec("study", path).model_dump(mode="json")}, path.name


def test_deployments_check_names_what_is_out_of_date(tmp_path, capsys):
    from flows.deployments import PREFECT_YAML, main

    out = tmp_path / "prefect.yaml"
    assert main(["--output", str(out)]) == 0
    assert out.read_text() == PREFECT_YAML.read_text()
    assert main(["--check", "--output", str(out)]) == 0
    data = yaml.safe_load(out.read_text())
    data["deployments"] = [d for d in data["deployments"] if d["name"] != "failure"]
    data["deployments"][0]["parameters"]["config"]["train"]["token_budget"] = 123
    data["deployments"].append({"name": "old", "entrypoint": "flows/pipeline.py:pipeline"})
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    capsys.readouterr()
    assert main(["--check", "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "pipeline/default: parameters.config.train.token_budget: 123 in prefect.yaml, 2000000 generated" in err
    assert "pipeline/failure: missing" in err
    assert "pipeline/old: not generated from any config" in err
    assert main(["--check", "--output", str(tmp_path / "absent.yaml")]) == 1


# ---------------------------------------------------------------------------------------------
# The UI form and parameter validation outside the defining module (fault 1, without a server)


def _flows_and_params():
    from configs.load import load_config
    from flows.goodput import goodput
    from flows.pipeline import pipeline
    from flows.pretrain import pretrain_diloco, pretrain_dp

    tiny = load_config(REPO / "configs" / "tiny.yaml").model_dump(mode="json")
    return [
        (pipeline, {"config": tiny, "config_file": None, "overrides": FAST, "run_dir": "x"}),
        (pipeline, {"config_file": "tiny"}),
        (pretrain_diloco, {"config": tiny, "run_dir": "x", "progress_every_s": 1.0}),
        (pretrain_dp, {"config": tiny, "run_dir": "x"}),
        (goodput, {"config": {"seeds": 2}, "out_dir": None}),
    ]


def test_flow_parameters_validate_after_cloudpickle():
    """`flow.serve()` runs each flow run in a spawned process that gets the flow by cloudpickle,
    which copies the function by value with only the globals its body uses. Parameter annotations
    must therefore be objects, not strings (no `from __future__ import annotations` in a flow
    module), or validation fails there with "... is not fully defined"."""
    import inspect

    for flow, params in _flows_and_params():
        strings = {
            n: p.annotation for n, p in inspect.signature(flow.fn).parameters.items() if isinstance(p.annotation, str)
        }
        assert not strings, f"flow {flow.name}: string annotations {strings} break flow.serve()"
        clone = pickle.loads(cloudpickle.dumps(flow))
        clone.validate_parameters(params)


def test_sweep_form_shows_every_spec_field_with_default_and_description():
    from prefect.utilities.callables import parameter_schema
    from pydantic_core import PydanticUndefined

    from configs.specs import load_spec
    from configs.sweep import SweepSpec
    from flows.sweep import sweep

    schema = parameter_schema(sweep).model_dump_for_openapi()
    props, defs = schema["properties"], schema["definitions"]
    assert list(props) == ["spec", "sweep_file", "sweep_dir"]
    assert all(props[name].get("description") for name in props)
    assert props["spec"]["default"] == load_spec("sweep", "tiny_grid").model_dump(mode="json")
    shown = defs["SweepSpec"]["properties"]
    for name, field in SweepSpec.model_fields.items():
        assert shown[name].get("description") == field.description, name
        if field.default is not PydanticUndefined:
            assert shown[name].get("default") == field.default, name


def test_tune_form_shows_every_study_field_with_its_description():
    from prefect.utilities.callables import parameter_schema

    from configs.specs import load_spec
    from configs.tune import TuneSpec
    from flows.tune import tune

    schema = parameter_schema(tune).model_dump_for_openapi()
    props, defs = schema["properties"], schema["definitions"]
    assert list(props) == ["spec", "study_file"]
    assert all(props[name].get("description") for name in props)
    assert props["spec"]["default"] == load_spec("study", "tune_tiny").model_dump(mode="json")
    shown = defs["TuneSpec"]["properties"]
    for name, field in TuneSpec.model_fields.items():
        assert shown[name].get("description") == field.description, name


def test_ui_form_shows_every_config_field_with_default_and_description():
    from prefect.utilities.callables import parameter_schema
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    from configs.schema import ExperimentConfig
    from flows.pipeline import pipeline

    schema = parameter_schema(pipeline).model_dump_for_openapi()
    props, defs = schema["properties"], schema["definitions"]
    assert list(props) == ["config", "config_file", "overrides", "run_dir", "dp_cache"]
    assert all(props[name].get("description") for name in props)
    assert props["config"]["$ref"] == "#/definitions/ExperimentConfig"
    assert props["config"]["default"] == ExperimentConfig().model_dump(mode="json")

    def walk(model: type[BaseModel]) -> int:
        shown = defs[model.__name__]["properties"]
        n = 0
        for name, field in model.model_fields.items():
            assert name in shown, f"{model.__name__}.{name} is not in the form"
            if field.description:
                assert shown[name].get("description") == field.description, f"{model.__name__}.{name}"
            if field.default is not PydanticUndefined:
                default = (
                    field.default.model_dump(mode="json") if isinstance(field.default, BaseModel) else field.default
                )
                assert shown[name].get("default") == default, f"{model.__name__}.{name}"
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                n += walk(sub)
            else:
                n += 1
        return n

    assert walk(ExperimentConfig) > 60  # every leaf field of every section


# ---------------------------------------------------------------------------------------------
# The routes, end to end


@pytest.fixture
def route_env(prefect_harness, tmp_path):
    """Environment for child processes: the session's test server, a private PREFECT_HOME, fast
    polling, and PWD = the repository (prefect.yaml's pull step sets the working directory to it)."""
    from prefect.settings import PREFECT_API_URL

    return {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        "PWD": str(REPO),
    }


def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    """A child in its own process group (so it and what it spawns can be stopped together)."""
    with open(log, "ab") as fh:
        return subprocess.Popen(
            args,
            cwd=REPO,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, then SIGKILL what is left after 15 s (``make ui``'s own stop)."""
    stop_group(proc, term_wait_s=15.0)


def _wait_children_gone(proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until ``proc``'s child processes have exited, e.g. the process a
    Prefect runner spawned for a flow run that has just finished (multiprocessing's resource tracker,
    which lives as long as its parent, does not count)."""
    import psutil

    def working(child: psutil.Process) -> bool:
        try:
            return "multiprocessing.resource_tracker" not in " ".join(child.cmdline())
        except psutil.Error:  # exited meanwhile
            return False

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if not any(working(c) for c in psutil.Process(proc.pid).children(recursive=True)):
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.2)


def _tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def _run(args: list[str], env: dict, log: Path, timeout: float) -> None:
    proc = _start(args, env, log)
    try:
        assert proc.wait(timeout=timeout) == 0, f"{' '.join(args)} failed:\n{_tail(log)}"
    finally:
        _stop(proc)


def _assert_completed(flow_run, run_dir: Path, log: Path, name: str = "tiny") -> None:
    assert flow_run.state is not None and flow_run.state.is_completed(), (
        f"flow run {flow_run.name}: {flow_run.state}\n{_tail(log)}"
    )
    assert (run_dir / "report" / "report.md").is_file()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["name"] == name and config["train"]["token_budget"] == 3072
    assert config["data"]["source"] == "local" and config["data"]["paths"] == SMALL_DATA["data.paths"]
    layout = RunLayout(run_dir)
    assert layout.methods("pretrain") == ["diloco"]  # dp.enabled: false
    assert layout.summary("pretrain", "diloco").is_file() and layout.checkpoints("pretrain", "diloco").is_dir()


async def _read_deployment(name: str, deadline_s: float, proc: subprocess.Popen | None = None):
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    end = time.monotonic() + deadline_s
    async with get_client() as client:
        while True:
            try:
                return await client.read_deployment_by_name(name)
            except ObjectNotFound:
                if time.monotonic() > end or (proc is not None and proc.poll() is not None):
                    raise
                await asyncio.sleep(0.5)


@pytest.mark.process
@pytest.mark.slow
def test_flow_serve_and_a_sweep_through_the_deployment(route_env, tmp_path):
    """`pipeline.serve()` in a child process, and a one-cell sweep launched through that deployment
    (`launch: deployment`): `run_deployment` with the cell's whole config, run in the served process
    (not in the sweep's); the sweep records the run and builds its report."""
    from prefect.client.orchestration import get_client

    from configs.sweep import SweepSpec
    from flows.sweep import sweep

    log, sweep_dir = tmp_path / "serve.log", tmp_path / "sweep"
    serve = _start(
        [
            sys.executable,
            "-c",
            "from flows.pipeline import pipeline; pipeline.serve(name='serve-test', print_starting_message=False)",
        ],
        route_env,
        log,
    )
    try:
        try:
            dep = asyncio.run(_read_deployment("pipeline/serve-test", 120, serve))
        except Exception as exc:
            raise AssertionError(f"pipeline.serve() did not register ({exc}):\n{_tail(log)}") from None
        spec = SweepSpec(
            name="route",
            base="tiny",
            overrides=FAST,
            cells=[{"diloco.quorum": 1}],
            launch="deployment",
            deployment="pipeline/serve-test",
        )
        assert sweep(spec=spec, sweep_dir=str(sweep_dir)) == str(sweep_dir), _tail(log)
        cell = json.loads((sweep_dir / "sweep.json").read_text())["cells"][0]
        assert (cell["name"], cell["status"], cell["state"]) == ("quorum-1", "completed", "COMPLETED")

        async def read(run_id):
            async with get_client() as client:
                return await client.read_flow_run(run_id)

        # Read while the runner is up, and let its flow-run process exit before stopping it: the run
        # is COMPLETED on the server before that process has exited, and a runner told to shut down
        # cancels the runs whose processes are still alive (CI saw 'Cancelled: Runner is shutting down').
        flow_run = asyncio.run(read(cell["flow_run_id"]))
        _wait_children_gone(serve, 60)
    finally:
        _stop(serve)
    assert flow_run.deployment_id == dep.id  # run by the served deployment, not in this process
    run_dir = sweep_dir / "cells" / "quorum-1"
    _assert_completed(flow_run, run_dir, log, name="quorum-1")
    assert json.loads((run_dir / "config.json").read_text())["diloco"]["quorum"] == 1
    assert (sweep_dir / "report" / "comparison.md").is_file()


@pytest.mark.process
@pytest.mark.slow
def test_prefect_yaml_deploy_all(route_env, tmp_path):
    """`prefect deploy --all` from the repository's prefect.yaml: every deployment registered, with
    its parameters and form, the nightly sweep's schedule inactive. (A process worker running a
    prefect.yaml deployment, pipeline/tiny started from the UI form: tests/test_ui_browser.py.)"""
    from configs.load import load_config

    log = tmp_path / "deploy.log"
    _run([PREFECT, "work-pool", "create", "local-proc", "--type", "process", "--overwrite"], route_env, log, 60)
    _run([PREFECT, "--no-prompt", "deploy", "--all"], route_env, log, 180)
    dep = asyncio.run(_read_deployment("pipeline/tiny", 5))
    assert dep.parameters == {"config": load_config(REPO / "configs" / "tiny.yaml").model_dump(mode="json")}
    assert set(dep.parameter_openapi_schema["properties"]) == {
        "config",
        "config_file",
        "overrides",
        "run_dir",
        "dp_cache",
    }
    for name in (
        "pipeline/default",
        "pipeline/failure",
        "pretrain-diloco/pretrain-diloco",
        "pretrain-dp/pretrain-dp",
        "finetune/finetune",
        "goodput/goodput",
        "sweep/tiny_grid",
    ):
        asyncio.run(_read_deployment(name, 5))
    nightly = asyncio.run(_read_deployment("sweep/nightly", 5))  # the scheduled sweep, inactive as shipped
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in nightly.schedules] == [
        ("0 3 * * *", "UTC", False)
    ]
    assert set(nightly.parameter_openapi_schema["properties"]) == {"spec", "sweep_file", "sweep_dir"}
