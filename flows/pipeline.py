"""The pipeline flow: shard → pretrain (Decoupled DiLoCo, DP) → evaluate → report."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

from flax import nnx
from prefect import flow, get_run_logger

from configs.schema import ExperimentConfig, validate_against_model
from flows.pretrain import pretrain_diloco, pretrain_dp
from models import build_model
from diloco.params import get_params
from tasks.data import shard_data_task
from tasks.evaluate import evaluate_task, report_task


LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


def preflight(cfg: ExperimentConfig) -> None:
    """Checks beyond the schema, before any data is touched: P ≤ the model's tensors, and local
    corpus files exist with a supported suffix. Raises ``ValueError``/``FileNotFoundError`` naming
    the field."""
    if cfg.data.source == "local":
        for path in cfg.data.paths:
            p = Path(path).expanduser()
            if not p.is_file():
                raise FileNotFoundError(f"data.paths: file not found: {path}")
            if not p.name.endswith(LOCAL_SUFFIXES):
                raise ValueError(f"data.paths: {path} is not one of {', '.join(LOCAL_SUFFIXES)}")
    model = build_model(cfg.model, cfg.data.vocab_size, cfg.data.seq_len, nnx.Rngs(0))
    validate_against_model(cfg, len(get_params(model)))


def make_run_dir(cfg: ExperimentConfig, run_dir: str | None = None) -> Path:
    """``<run_root>/<name>-<UTC timestamp>`` (or ``run_dir``), with the resolved config in it."""
    if run_dir is None:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        run_dir = str(Path(cfg.run_root) / f"{cfg.name}-{stamp}")
    path = Path(run_dir).absolute()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
    return path


@flow(name="pipeline", log_prints=True)
def pipeline(config: ExperimentConfig = ExperimentConfig(), run_dir: str | None = None) -> str:
    """Run the whole experiment and return the run directory (the report is in ``report/``)."""
    logger = get_run_logger()
    preflight(config)
    created = run_dir is None or not Path(run_dir).exists()
    rd = make_run_dir(config, run_dir)
    logger.info("run directory: %s", rd)
    try:
        manifest = shard_data_task(config, rd)
    except BaseException:
        if created:  # never leave a half-made run behind: the data step writes nothing partial
            shutil.rmtree(rd, ignore_errors=True)
        raise
    logger.info("data: %s train tokens, %d shards, vocab %d", f"{manifest['splits']['train']['tokens']:,}",
                len(manifest["shards"]), manifest["vocab_size"])
    pretrain_diloco(config, str(rd))
    if config.dp.enabled:
        pretrain_dp(config, str(rd))
    if config.eval.enabled:
        for method in ["diloco"] + (["dp"] if config.dp.enabled else []):
            evaluate_task(config, rd, method)
    report_task(rd)
    logger.info("report: %s", rd / "report" / "report.md")
    return str(rd)
