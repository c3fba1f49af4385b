"""Which steps of a checkpoint folder are complete, read from the files alone (no JAX, no Orbax
import), so that the checks that run before any work (``ddiloco finetune``'s preflight) can refuse a
folder the loaders of :mod:`training.checkpoint` would refuse minutes later.

A step is complete when Orbax finalised it and it holds the items the loaders restore:

- its folder is named by the step number alone: Orbax writes a step into
  ``<step>.orbax-checkpoint-tmp-<n>`` and renames it to ``<step>`` only when every item is written
  (``CheckpointManager.all_steps()`` lists exactly these folders; checked with orbax-checkpoint 0.12.8);
- it holds the item folders ``params/`` and ``meta/`` (:func:`training.checkpoint.load_into_model`
  refuses a step without them: "has no item 'params'").

Damage inside a complete step (a truncated or corrupted file) is found by the loaders' integrity
check, which reads every file; they then fall back to an older intact step.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["LOADED_ITEMS", "complete_steps", "step_folders"]

LOADED_ITEMS = ("params", "meta")


def step_folders(ckpt_dir: str | Path) -> list[str]:
    """Names of the entries of ``ckpt_dir`` that look like steps, finished or not (a number, or an
    interrupted save's ``<step>.orbax-checkpoint-tmp-*``), sorted; empty when the folder is missing."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.is_dir() and p.name.split(".", 1)[0].isdigit())


def complete_steps(ckpt_dir: str | Path, items: tuple[str, ...] = LOADED_ITEMS) -> list[int]:
    """The complete steps of ``ckpt_dir`` (see the module docstring), ascending; ``[]`` when the
    folder is missing or holds none. ``items``: the item folders a step must hold."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    return sorted(
        int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit() and all((p / i).is_dir() for i in items)
    )
