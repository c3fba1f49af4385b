import functools
import os
import re

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# One JAX compilation cache for the whole suite and every process it starts (xdist workers, CLI runs,
# Ray and Dask workers inherit the variables): the same tiny programs compile once, not once per test
# and process. tests/test_golden.py took 27.6 s of user CPU without it, 24.9 s with it cold, 14.4 s
# warm. It lives in build/ (ignored) and is kept between runs; delete it to measure a cold run.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / "build" / "jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The committed small corpus: ten plays of the default corpus, cut short (tests/data/README.md).
SMALL_CORPUS = ROOT / "tests" / "data" / "shakespeare_small.jsonl"
# ``--set``/``overrides`` that put the tiny config on it (no network, seconds to prepare).
SMALL_DATA = {"data.source": "local", "data.paths": [str(SMALL_CORPUS)]}


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (about 7 s), started on first use."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def small_cfg():
    """The tiny config on the committed small corpus (:data:`SMALL_DATA`): no network."""
    from configs.load import load_config

    return load_config(ROOT / "configs" / "tiny.yaml", SMALL_DATA)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory, small_cfg):
    """A run directory with :func:`small_cfg`'s data prepared once per session (copy it before
    training into it)."""
    from data.prepare import prepare_data

    run_dir = tmp_path_factory.mktemp("small-data")
    prepare_data(small_cfg, run_dir)
    return run_dir


def jsonl_finetune_run(small_cfg, small_data, tmp_path, **finetune):
    """``(cfg, run_dir, layout, task)``: a copy of ``small_data`` with a random-init (seed ``cfg.seed``)
    'pretrained' dp checkpoint at step 1 and a prepared jsonl task of 40 sums (32 train, 8 test);
    ``finetune`` keys replace the recipe's (4 steps of 4 rows, lr 0.01, no warm-up)."""
    import json
    import shutil

    from configs.schema import ExperimentConfig
    from data.finetune import prepare_finetune_data
    from run.layout import RunLayout
    from training.checkpoint import save_checkpoint
    from training.common import model_spec
    from training.functional import nest, params_of

    run_dir = tmp_path / "run"
    shutil.copytree(small_data, run_dir)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": f"{i} plus {i} is", "response": f" {2 * i}\n"}) + "\n" for i in range(40))
    )
    cfg = ExperimentConfig.model_validate(
        {
            **small_cfg.model_dump(),
            "finetune": {
                "enabled": True,
                "source": "jsonl",
                "paths": [str(pairs)],
                "steps": 4,
                "batch_size": 4,
                "eval_every_steps": 4,
                "seeds": [0],
                "optimizer": {"lr": 0.01, "warmup_steps": 0},
                **finetune,
            },
        }
    )
    layout = RunLayout(run_dir)
    save_checkpoint(
        layout.checkpoints("pretrain", "dp"),
        1,
        nest(params_of(model_spec(cfg.model, cfg.data, cfg.runtime, run_dir).init(cfg.seed))),
        {"method": "dp"},
    )
    task = prepare_finetune_data(cfg.finetune, cfg.finetune_task, cfg.data, run_dir, layout.finetune_data)
    return cfg, run_dir, layout, task


def squash(md: str) -> str:
    """Markdown with the tables' alignment padding (tabulate's) removed, so a test can name a row
    by its cells: ``"| a    | b  |"`` → ``"| a | b |"``."""
    import re

    return re.sub(r" +\|", " |", re.sub(r"(?<!\\)\| +", "| ", md))


# -- pytest-xdist: ``make test`` runs 2 workers, ``--dist loadscope --no-loadscope-reorder`` ---------
# A work unit is a whole module (its module-scoped runs are made once), except that every module
# holding a ``cluster`` test (one that starts a local Ray or Dask cluster) joins one unit, run by one
# worker one test at a time: two clusters starting at once beside a Prefect server overload 2 cores
# (Ray's start then outlasts its own 30-s wait, flows.engines.start_local_ray). Other tests that start
# processes (the CLI, a fresh learner process, the UI's server and browser) spread like any module.
# (pytest-xdist's own ``xdist_group``/``loadgroup`` does not group under pytest 9.2: it renames
# ``item._nodeid``, which pytest no longer reads.)
CLUSTERS_UNIT = "tests/(the tests that start Ray or Dask clusters)"


@functools.cache
def _starts_clusters(module: str) -> bool:
    text = (ROOT / module).read_text() if (ROOT / module).is_file() else ""
    return re.search(r"\bmark\.cluster\b", text) is not None


def _unit(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return CLUSTERS_UNIT if _starts_clusters(module) else module


@pytest.hookimpl(optionalhook=True)  # (pytest without pytest-xdist, or with -p no:xdist, runs too)
def pytest_xdist_make_scheduler(config, log):
    """The controller's scheduler under ``--dist loadscope``: LoadScope with the units above."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ClustersApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ClustersApart(config, log)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist the units run longest first (a ``process``/``browser`` test counts 40 s, a
    ``slow`` one 15 s, any other 0.3 s), so the quick ones fill the end; the order within a unit is
    kept. A run without workers keeps the collection order."""
    if not hasattr(config, "workerinput"):  # (the workers collect; the controller only schedules)
        return

    def seconds(item) -> float:
        marks = {m.name for m in item.iter_markers()}
        return 40.0 if marks & {"process", "browser"} else 15.0 if "slow" in marks else 0.3

    stray = [i.nodeid for i in items if "cluster" in {m.name for m in i.iter_markers()}]
    stray = [n for n in stray if _unit(n) != CLUSTERS_UNIT]
    if stray:  # (the scheduler finds those modules by the text of their marks)
        raise pytest.UsageError(f"mark cluster tests with @pytest.mark.cluster on the test: {stray[:3]}")
    weight: dict[str, float] = {}
    for item in items:
        weight[_unit(item.nodeid)] = weight.get(_unit(item.nodeid), 0.0) + seconds(item)
    items.sort(key=lambda i: -weight[_unit(i.nodeid)])  # (a stable sort)


# -- a local S3-compatible endpoint (moto's server mode, as s3fs's own tests use) -----------------------
S3_BUCKET = "ddiloco-test"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A moto S3 server on a free loopback port for this worker's session, with :data:`S3_BUCKET`
    created; yields the environment a client needs (credentials and endpoint: the exchange reads
    them from the environment, as on a cluster). The server dies with the test process (SIGKILL
    via PR_SET_PDEATHSIG), so a failed or killed session leaves nothing running."""
    from tests.s3_endpoint import MotoServer

    with MotoServer(log=tmp_path_factory.mktemp("moto") / "moto.log") as server:
        server.create_bucket(S3_BUCKET)
        yield server


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """:func:`s3_server`'s credentials and endpoint in this test's environment (restored after)."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    return s3_server.env
