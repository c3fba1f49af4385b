"""Every check that can run before Prefect and JAX start, in one place.

``ddiloco run`` calls :func:`preflight` before it starts Prefect; the pipeline flow calls it again
first thing (a run started from the UI never went through the CLI). It writes nothing: the run
directory is created only after every check has passed.
"""

from __future__ import annotations

from pathlib import Path

from configs.schema import ExperimentConfig, validate_against_model
from run.directory import check_run_dir, default_run_dir

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


def check_local_paths(cfg: ExperimentConfig) -> None:
    """Local corpus files exist and have a supported suffix (cheap; no file is read)."""
    if cfg.data.source != "local":
        return
    for path in cfg.data.paths:
        p = Path(path).expanduser()
        if p.is_dir():
            raise ValueError(f"data.paths: {path} is a folder; list the files in it")
        if not p.is_file():
            raise FileNotFoundError(f"data.paths: file not found: {path}")
        if not p.name.lower().endswith(LOCAL_SUFFIXES):
            raise ValueError(f"data.paths: {path} is not one of {', '.join(LOCAL_SUFFIXES)}")


def check_reusable_data(cfg: ExperimentConfig, path: Path) -> None:
    """A run directory that already holds ``data/`` (an earlier run's, that never trained) is used
    only when that data was built from this config's data section and learner count.
    Raises ``ValueError`` naming the folder and the fix."""
    data = path / "data"
    if not data.exists() and not data.is_symlink():
        return
    from data.store import load_manifest
    from data.text import config_record

    try:
        manifest = load_manifest(path)
        if not isinstance(manifest, dict):
            raise ValueError("its manifest.json is not a JSON object")
        old = manifest.get("config")
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise ValueError(f"run directory {path} holds a data folder that cannot be reused ({exc}); choose a "
                         "new --run-dir") from None
    if old != config_record(cfg):
        raise ValueError(f"run directory {path} holds data built from another data config or learner count; "
                         "choose a new --run-dir")


def check_model(cfg: ExperimentConfig) -> int:
    """Build the model abstractly (shapes only, no compute) and check P against its tensors.

    Returns the number of parameter tensors. Raises ``ValueError`` naming ``diloco.fragments``.
    """
    from flax import nnx

    from models import InputShape, build_model
    from training.functional import params_of

    spec = build_model(cfg.model, InputShape(vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len))
    n = len(params_of(nnx.eval_shape(lambda: spec.init(0))))
    validate_against_model(cfg, n)
    return n


def preflight(cfg: ExperimentConfig, run_dir: str | Path | None = None, check_data: bool = True) -> Path:
    """Check the run directory, the corpus and the model; return the run directory to use.

    Order: the run directory (``run.directory.check_run_dir``; ``<run_root>/<name>-<time>`` when
    ``run_dir`` is None), local file paths, the model's tensors against ``diloco.fragments``, then
    the corpus itself (``data.sources.check_corpus``: encodings, empty or too few documents, a
    reachable hub dataset) unless ``check_data`` is False. Nothing is written anywhere but the
    corpus download cache.

    Raises ``ValueError``, ``FileNotFoundError`` or ``ConnectionError`` with one line naming the
    field or path and the fix.
    """
    path = check_run_dir(run_dir if run_dir is not None else default_run_dir(cfg.run_root, cfg.name))
    check_reusable_data(cfg, path)
    check_local_paths(cfg)
    check_model(cfg)
    if check_data:
        from data.sources import check_corpus

        check_corpus(cfg.data)
    return path
