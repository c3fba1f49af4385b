"""Orbax checkpoints of model parameters (and, for DiLoCo, the syncer's outer state).

Layout: ``<ckpt_dir>/<step>/{params, meta[, outer_state]}`` written by ``ocp.CheckpointManager``.
Orbax writes each step into a temporary folder and renames it into place only when complete, so a
crash never leaves a readable half-checkpoint; readers only see finalized steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing, holds no complete step, or does not match the model."""


def _abstract(tree):
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), tree)


def save_checkpoint(ckpt_dir: str | Path, step: int, params: Any, meta: dict, extra: dict[str, Any] | None = None) -> Path:
    """Save ``params`` (a pytree, e.g. ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``), JSON
    ``meta`` and optional extra pytrees under ``ckpt_dir/step``; blocks until written.

    Returns the step folder. Raises ``FileExistsError`` if that step exists: a checkpoint that a
    later step may read is never overwritten.
    """
    ckpt_dir = Path(ckpt_dir).absolute()
    if (ckpt_dir / str(step)).exists():
        raise FileExistsError(f"checkpoint {ckpt_dir / str(step)} already exists; it is never overwritten")
    items = {"params": ocp.args.StandardSave(params), "meta": ocp.args.JsonSave(meta)}
    for name, tree in (extra or {}).items():
        items[name] = ocp.args.StandardSave(tree)
    with ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2)) as mngr:
        mngr.save(step, args=ocp.args.Composite(**items))
        mngr.wait_until_finished()
    return ckpt_dir / str(step)


def latest_step(ckpt_dir: str | Path) -> int:
    """The newest complete step. Raises :class:`CheckpointError` if there is none."""
    ckpt_dir = Path(ckpt_dir).absolute()
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint folder {ckpt_dir} does not exist; run pretraining first")
    with ocp.CheckpointManager(ckpt_dir) as mngr:
        step = mngr.latest_step()
    if step is None:
        raise CheckpointError(
            f"{ckpt_dir} holds no complete checkpoint (an interrupted save leaves only a temporary "
            "folder); re-run pretraining for this method"
        )
    return step


def load_meta(ckpt_dir: str | Path, step: int | None = None) -> dict:
    ckpt_dir = Path(ckpt_dir).absolute()
    step = latest_step(ckpt_dir) if step is None else step
    with ocp.CheckpointManager(ckpt_dir) as mngr:
        return dict(mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)


def load_into_model(ckpt_dir: str | Path, model: nnx.Module, step: int | None = None) -> dict:
    """Restore the latest (or given) step's params into ``model`` in place; returns its meta.

    Raises :class:`CheckpointError` when there is no complete step or the shapes do not match.
    """
    ckpt_dir = Path(ckpt_dir).absolute()
    step = latest_step(ckpt_dir) if step is None else step
    state = nnx.state(model, nnx.Param)
    target = nnx.to_pure_dict(state)
    try:
        with ocp.CheckpointManager(ckpt_dir) as mngr:
            restored = mngr.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_abstract(target)), meta=ocp.args.JsonRestore()))
    except Exception as exc:  # orbax raises a variety of errors for mismatched trees/files
        raise CheckpointError(f"cannot restore {ckpt_dir}/{step} into this model: {exc}") from exc
    nnx.replace_by_pure_dict(state, restored.params)
    nnx.update(model, state)
    return dict(restored.meta)


def load_extra(ckpt_dir: str | Path, name: str, like: Any, step: int | None = None) -> Any:
    """Restore an extra pytree saved by :func:`save_checkpoint` with the structure of ``like``."""
    ckpt_dir = Path(ckpt_dir).absolute()
    step = latest_step(ckpt_dir) if step is None else step
    with ocp.CheckpointManager(ckpt_dir) as mngr:
        restored = mngr.restore(step, args=ocp.args.Composite(**{name: ocp.args.StandardRestore(_abstract(like))}))
    return restored[name]
