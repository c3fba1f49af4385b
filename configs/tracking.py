"""The ``tracking`` section: where a run's metrics go besides its ``metrics/*.jsonl`` files."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat

from configs.base import _Strict


class TrackingConfig(_Strict):
    """TensorBoard event files and Weights & Biases runs, fed from the same records as the JSONL
    metric files (``run.tracking``). Neither changes what is trained or measured."""

    tensorboard: bool = Field(
        True,
        description="TensorBoard event files per method and per learner under the run directory "
        "(`tensorboard --logdir runs/` overlays every run; the run's settings and final losses go to the HParams tab)",
    )
    wandb: bool = Field(
        False,
        description="also log to Weights & Biases, one W&B run per method and per learner, grouped by run "
        "(needs the wandb package: `uv sync --extra wandb`)",
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: W&B runs are written under RUN/wandb/ and uploaded later with `wandb sync`; "
        "online: sent as they run (needs `wandb login` and the network)",
    )
    wandb_project: str = Field("decoupled-diloco", min_length=1, description="the W&B project the runs belong to")
    wandb_entity: str | None = Field(None, description="the W&B team or user (default: the logged-in user's)")
    flush_s: PositiveFloat = Field(
        10.0, description="seconds between flushes of the event files (how fresh a live TensorBoard is)"
    )
    peak_tflops: PositiveFloat | None = Field(
        None,
        description="one device's peak TFLOP/s for the logged MFU; default: the datasheet figure of a known "
        "accelerator (training/peaks.py), none on a CPU (MFU then is not logged)",
    )
