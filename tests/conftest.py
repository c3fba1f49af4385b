import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (about 7 s), started on first use."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def tiny_cfg():
    """The pulse-test config: real Shakespeare text, a 2-layer d_model-32 model, 3 learners."""
    from configs.schema import load_config

    return load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.yaml"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, tiny_cfg):
    """A run directory with the tiny config's data prepared once per session."""
    from data.text import prepare_data

    run_dir = tmp_path_factory.mktemp("tiny-data")
    prepare_data(tiny_cfg, run_dir)
    return run_dir
