"""JAX's persistent compilation cache of a run (``runtime.compilation_cache``): the setting's
values, and two processes sharing compiled steps the way the flow and a learner process do."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from configs.specs import load_spec
from run.layout import RunLayout

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value", [None, False, "off", "OFF", "null"])
def test_the_cache_turns_off(value):
    cfg = load_spec("config", ROOT / "configs" / "tiny.yaml", {"runtime.compilation_cache": value})
    assert cfg.runtime.compilation_cache is None


@pytest.mark.parametrize("value", ["", "  ", "s3://bucket/xla", "gs://b/x"])
def test_a_cache_that_is_not_a_local_folder_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"runtime\.compilation_cache: .* is not a local folder: write run"):
        load_spec("config", ROOT / "configs" / "tiny.yaml", {"runtime.compilation_cache": value})


def test_where_the_cache_lives(tmp_path, monkeypatch):
    from training.common import compilation_cache_dir

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    cfg = load_spec("config", ROOT / "configs" / "tiny.yaml", {})
    assert compilation_cache_dir(cfg.runtime, tmp_path) == tmp_path / "cache" / "xla"
    # the seeds of a run of several share the run's cache: they compile the same steps
    assert RunLayout(tmp_path / "seeds" / "seed-1").compile_cache == tmp_path / "cache" / "xla"
    shared = load_spec("config", ROOT / "configs" / "tiny.yaml", {"runtime.compilation_cache": "~/xla-cache"})
    assert compilation_cache_dir(shared.runtime, tmp_path) == Path("~/xla-cache").expanduser()
    off = load_spec("config", ROOT / "configs" / "tiny.yaml", {"runtime.compilation_cache": None})
    assert compilation_cache_dir(off.runtime, tmp_path) is None
    # a cache the environment names (the user's, or the test suite's) is the one "run" uses
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert compilation_cache_dir(cfg.runtime, tmp_path) == tmp_path / "mine"
    assert compilation_cache_dir(off.runtime, tmp_path) is None


def _compile_in_a_process(inputs: Path, what: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # the suite's own
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "compile_process.py"), str(inputs), what],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.process
def test_a_learner_process_loads_the_steps_the_flow_compiled(small_cfg, small_data, tmp_path):
    """The flow's warm-up (``warm_compilation_cache``) compiles the learner step and the evaluation
    into the run's ``cache/xla``; a learner process that builds its own trainer then finds both
    there (cache hits, no miss for them) instead of compiling them again. With the cache off
    nothing is written and nothing is loaded."""
    from configs.schema import ExperimentConfig

    run_dir = tmp_path / "run"
    shutil.copytree(small_data, run_dir)
    cfg = ExperimentConfig.model_validate(
        {**small_cfg.model_dump(), "runtime": {**small_cfg.runtime.model_dump(), "engine": "dask"}}
    )
    inputs = tmp_path / "inputs.pkl"
    inputs.write_bytes(pickle.dumps({"config": cfg, "run_dir": str(run_dir)}))
    cache = RunLayout(run_dir).compile_cache

    warm = _compile_in_a_process(inputs, "warm")
    assert warm["dir"] == str(cache)
    written = sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache"))
    assert warm["events"].get("cache_misses", 0) >= 2 and len(written) >= 2  # the step and the evaluation

    learner = _compile_in_a_process(inputs, "learner")
    assert learner["dir"] == str(cache)
    assert learner["events"].get("cache_hits", 0) >= 2, learner  # the step and the evaluation, loaded
    # no step or evaluation compiled again (an eager op's kernel may be: > 0.1 s to compile under load)
    steps = [n for n in written if n.startswith(("jit_step-", "jit_evaluate-")) and n.endswith("-cache")]
    assert len(steps) == 2, written
    after = sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache"))
    assert [n for n in after if n.startswith(("jit_step-", "jit_evaluate-"))] == steps, after

    off = tmp_path / "off.pkl"
    off.write_bytes(
        pickle.dumps(
            {
                "config": cfg.model_copy(
                    update={"runtime": cfg.runtime.model_copy(update={"compilation_cache": None})}
                ),
                "run_dir": str(run_dir),
            }
        )
    )
    shutil.rmtree(cache)
    alone = _compile_in_a_process(off, "learner")
    assert alone["dir"] is None and not alone["events"].get("cache_hits") and not cache.exists()
