"""The ``runtime`` section (engine, exchange, devices) and ``precision`` (the dtype policy)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from configs.base import _Strict


class RuntimeConfig(_Strict):
    """Where learners and the syncer run, how they exchange fragments, and on how many devices each
    learner trains."""

    engine: Literal["threads", "ray", "dask"] = Field(
        "threads",
        description="task runner for the learner and syncer tasks: threads (one process; "
        "Prefect's ThreadPoolTaskRunner), ray (prefect-ray's RayTaskRunner) or dask (prefect-dask's "
        "DaskTaskRunner): with ray and dask every learner and the syncer run in their own process",
    )
    address: str | None = Field(
        None,
        description="an existing cluster to run on: a Ray head's GCS address (host:6379, the run on a "
        "node of the cluster; ray://host:10001 through Ray Client; or auto) or a Dask scheduler "
        "(tcp://host:8786); unset = a local cluster started for the run",
    )
    exchange: Literal["memory", "fsspec"] | None = Field(
        None,
        description="how learners and the syncer exchange fragments: memory (threads of one "
        "process) or fsspec (durable objects in runtime.exchange_url, any process or host); unset = "
        "fsspec with ray, dask or an exchange_url, else memory",
    )
    exchange_url: str | None = Field(
        None,
        description="fsspec URL of the exchange (a shared folder, s3://bucket/prefix, "
        "gs://bucket/prefix; an object store's credentials come from the environment, never from "
        "here); unset = pretrain/diloco/exchange inside the run directory",
    )
    exchange_poll_s: PositiveFloat = Field(
        0.02,
        description="seconds between two reads of the fsspec exchange's pointer and inbox "
        "(bounds the storage request rate of each process)",
    )
    start_wait_s: float = Field(
        120.0,
        ge=0.0,
        description="ray and dask: before its first step a learner waits at most this long "
        "(seconds) for all learners to be up (processes start seconds apart: each imports JAX and compiles); "
        "0 = no wait. "
        "Once training has started no learner waits for another",
    )
    compilation_cache: str | None = Field(
        "run",
        description="JAX's persistent compilation cache, so that each step is compiled once for every "
        "process of the run (Ray and Dask learner processes, retried learners, fine-tuning seeds, "
        "evaluations): run = cache/xla inside the run directory (or JAX_COMPILATION_CACHE_DIR when the "
        "environment sets it); a local folder (~ expanded) shares "
        "compiled steps across runs too; null (or off) = off: every process compiles its own",
    )
    max_workers: PositiveInt | None = Field(
        None,
        description="threads of the task runner; unset = learners + 2 (every learner, the "
        "syncer and the flow's own waits at once)",
    )
    learner_gpus: NonNegativeInt | None = Field(
        None,
        description="GPUs Ray reserves for each learner task (runtime.engine ray): Ray sets "
        "CUDA_VISIBLE_DEVICES, so learners train on disjoint GPUs, and learners with GPUs of their own "
        "skip the host's compute turns; unset = runtime.devices_per_learner when the Ray cluster has "
        "at least diloco.learners × that many GPUs, else 0 (CPU, or learners share the GPUs)",
    )
    devices_per_learner: PositiveInt = Field(
        1,
        description="devices each DiLoCo learner trains on, data-parallel (a jax.sharding mesh: "
        "parameters replicated, each batch split by rows); learner m takes devices [m·d, (m+1)·d) of "
        "the process, wrapping round (learners then share devices) when there are fewer than "
        "learners × d; must divide the device count and diloco.batch_size (and "
        "train.microbatch_size). The DP baseline uses every device of the process.",
    )

    @field_validator("compilation_cache", mode="before")
    @classmethod
    def _cache_folder(cls, v):
        if v is False or (isinstance(v, str) and v.strip().lower() in ("off", "false", "none", "null")):
            return None  # YAML reads a bare `off` as False; --set passes "off" as text
        if isinstance(v, str) and (not v.strip() or "://" in v):
            raise ValueError(
                f"{v!r} is not a local folder: write run (the run directory's cache/xla), a local "
                "folder such as ~/.cache/ddiloco-xla, or null (off)"
            )
        return v

    @property
    def exchange_kind(self) -> str:
        """The exchange in use: ``exchange``, or fsspec with ray, dask or an ``exchange_url``, else memory."""
        if self.exchange:
            return self.exchange
        return "fsspec" if self.engine != "threads" or self.exchange_url else "memory"

    @model_validator(mode="after")
    def _check(self) -> RuntimeConfig:
        if self.engine != "threads" and self.exchange == "memory":
            raise ValueError(
                f"runtime.exchange memory cannot reach learners in other processes "
                f"(runtime.engine {self.engine}); use runtime.exchange fsspec or unset it"
            )
        if self.address is not None and self.engine == "threads":
            raise ValueError(
                "runtime.address names a Ray or Dask cluster: set runtime.engine ray or dask, or unset runtime.address"
            )
        if self.engine != "threads" and (self.exchange_url or "").startswith("memory://"):
            raise ValueError(
                f"runtime.exchange_url {self.exchange_url}: a memory:// store lives in one process and "
                f"cannot be shared by the worker processes of runtime.engine {self.engine}; use a shared "
                "folder or object storage (s3://, gs://), or unset it"
            )
        if self.learner_gpus is not None and self.engine != "ray":
            raise ValueError(
                f"runtime.learner_gpus is a Ray resource request; runtime.engine is {self.engine}: "
                "set runtime.engine ray, or unset runtime.learner_gpus"
            )
        if self.exchange_url is not None and self.exchange == "memory":
            raise ValueError(
                "runtime.exchange_url is used by the fsspec exchange only: set runtime.exchange "
                "fsspec, or unset runtime.exchange_url"
            )
        return self


class PrecisionConfig(_Strict):
    """The precision policy of every model family, both methods and fine-tuning (``training.precision``).

    ``params``: the dtype the trained parameters are kept in; ``compute``: the forward and backward
    passes (matmuls, activations); ``opt_state``: the optimizer state's moments. Whatever the
    policy, the loss, softmaxes, the MoE router, gradient sums over microbatches, the fragments a
    learner sends, the outer gradients, the syncer's global fragments and outer momentum, and final
    checkpoints are float32. ``compute: bfloat16`` with float32 ``params`` is the usual mixed
    precision of accelerators (bfloat16 tensor cores); on a CPU it is usually slower than float32.
    """

    params: Literal["float32", "bfloat16"] = Field("float32", description="dtype of the trained parameters")
    compute: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the forward and backward passes (bfloat16: accelerators' mixed precision)"
    )
    opt_state: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the optimizer state's moments (AdamW's first and second moments)"
    )

    def describe(self) -> str:
        """One line for logs and reports: ``params float32 · compute bfloat16 · optimizer state float32``."""
        return f"params {self.params} · compute {self.compute} · optimizer state {self.opt_state}"
