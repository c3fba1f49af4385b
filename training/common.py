"""What both methods share: the model spec for a run's data, the token budget, refusing to retrain."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from configs.chaos import ChaosSchedule
from configs.data import DataConfig
from configs.model import ModelConfig
from configs.runtime import RuntimeConfig
from data.store import load_manifest
from models import InputShape, ModelSpec, build_model
from run.atomic import write_json
from run.layout import RunLayout
from training.xla import use_compilation_cache


def budget_status(
    trained: int, budget: int, unit: str, *, interrupted: bool, finished: bool, why: str | None = None
) -> dict:
    """Whether a pretraining stage trained its budget, and if not, why (the pipeline fails a ``short`` stage).

    ``trained``/``budget``: ``unit`` (tokens, or images) trained and the stage's budget
    (``ExperimentConfig.budget_tokens``). ``interrupted``: stopped by a signal. ``finished``: a worker ran to the
    end of the budget (a DiLoCo learner that stopped because no token was left to claim; the DP job
    that took its last step): what then stays unclaimed is the exchange's remainder (less than a
    step, or a grant a dead learner held), not work that could not be done. ``why``: one phrase, why
    the workers stopped.

    Returns ``status`` (``complete``: every token trained, or a worker finished; ``interrupted``;
    ``short``: stopped early with no worker left), ``trained``, ``budget``, ``share`` (trained /
    budget, 0 for an empty budget), ``unit``, ``reason`` (``why`` when short) and ``line`` (when short:
    ``trained 0 of 24,576 tokens (0.0 % of its budget): <why>``, else None).
    """
    share = trained / budget if budget > 0 else 0.0
    if trained >= budget or finished:
        status = "complete"
    else:
        status = "interrupted" if interrupted else "short"
    why = why or "its workers stopped before the budget was spent"
    line = (
        f"trained {trained:,} of {budget:,} {unit} ({100 * share:.1f} % of its budget): {why}"
        if status == "short"
        else None
    )
    return {
        "status": status,
        "trained": int(trained),
        "budget": int(budget),
        "share": share,
        "unit": unit,
        "reason": why if status == "short" else None,
        "line": line,
    }


_SPECS: dict[tuple, ModelSpec] = {}
_SPECS_LOCK = threading.Lock()


def input_shape(data: DataConfig, manifest: dict) -> InputShape:
    """What the prepared data (its ``manifest``; text: ``data.seq_len``) fixes about the model: the
    vocabulary and sequence length, or the image shape, classes and pixel range."""
    if manifest.get("modality", "text") == "image":
        return InputShape(
            image_shape=tuple(manifest["image_shape"]),
            num_classes=int(manifest["num_classes"]),
            pixel_max=int(manifest["pixel_max"]),
        )
    return InputShape(vocab_size=int(manifest["vocab_size"]), seq_len=data.seq_len)


def model_spec(model: ModelConfig, data: DataConfig, runtime: RuntimeConfig, run_dir: str | Path) -> ModelSpec:
    """The spec of ``model`` for the data prepared in ``run_dir`` (its vocabulary and ``data.seq_len``,
    or its image shape, classes and pixel range).

    Built once per process for each model config and data shape (learner threads share it).
    ``model`` may be any registered kind's config object (``models.spec.register``). Every
    path that compiles a model's steps asks for its spec here, so this also points the process's
    JAX compilation cache at the run's (``runtime.compilation_cache``, :func:`compilation_cache_dir`).
    """
    use_compilation_cache(compilation_cache_dir(runtime, run_dir))
    shape = input_shape(data, load_manifest(run_dir))
    key = (repr(model), shape)
    with _SPECS_LOCK:
        if key not in _SPECS:
            _SPECS[key] = build_model(model, shape)
        return _SPECS[key]


def compilation_cache_dir(runtime: RuntimeConfig, run_dir: str | Path) -> Path | None:
    """The folder of ``runtime.compilation_cache``: ``run`` = the folder of the environment's
    ``JAX_COMPILATION_CACHE_DIR`` when set (a cache the user or the test suite keeps), else the run's
    ``cache/xla`` (:attr:`run.layout.RunLayout.compile_cache`), or None when the run directory is
    not a local path (object storage: JAX's cache wants a file lock); a folder; None when off."""
    setting = runtime.compilation_cache
    if setting is None:
        return None
    if setting == "run":
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            return Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).expanduser()
        return Path(RunLayout(run_dir).compile_cache) if "://" not in str(run_dir) else None
    return Path(setting).expanduser()


def ensure_fresh(run_dir: str | Path, stage: str, method: str) -> None:
    """Refuse to train ``method`` again into a run directory that already holds its results.

    Raises ``FileExistsError`` naming what exists and the fix; nothing is written or deleted.
    """
    layout = RunLayout(run_dir)
    existing = layout.holds_results(stage, method)
    if existing:
        raise FileExistsError(
            f"{run_dir} already holds {stage} {method} results "
            f"({', '.join(str(p.relative_to(layout.root)) for p in existing)}); "
            "pass a new run directory, or delete those paths to train this method again"
        )


def save_chaos_schedule(sched: ChaosSchedule | None, run_dir: str | Path) -> ChaosSchedule | None:
    """Write the run's chaos schedule (``cfg.chaos_schedule()``) to ``RUN/pretrain/chaos.json`` unless
    it is there already (both pretraining methods call this; the first writes, atomically). Returns
    ``sched`` (None: the config has none, nothing written)."""
    if sched is not None:
        path = RunLayout(run_dir).chaos_schedule
        if not path.exists():
            write_json(path, sched.model_dump(mode="json"))
    return sched
