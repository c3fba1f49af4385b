import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
def tiny_cfg():
    """The pulse-test config as shipped: the real default corpus (``data.source: shakespeare``,
    downloaded once and cached), a 2-layer d_model-32 model, 3 learners. Only the one end-to-end test
    of the default corpus uses it; every other quick run uses :func:`small_cfg`."""
    from configs.schema import load_config

    return load_config(ROOT / "configs" / "tiny.yaml")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, tiny_cfg):
    """A run directory with the tiny config's data (the real corpus) prepared once per session."""
    from data.text import prepare_data

    run_dir = tmp_path_factory.mktemp("tiny-data")
    prepare_data(tiny_cfg, run_dir)
    return run_dir


@pytest.fixture(scope="session")
def small_cfg():
    """The tiny config on the committed small corpus (:data:`SMALL_DATA`): no network."""
    from configs.schema import load_config

    return load_config(ROOT / "configs" / "tiny.yaml", SMALL_DATA)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory, small_cfg):
    """A run directory with :func:`small_cfg`'s data prepared once per session (copy it before
    training into it)."""
    from data.text import prepare_data

    run_dir = tmp_path_factory.mktemp("small-data")
    prepare_data(small_cfg, run_dir)
    return run_dir
