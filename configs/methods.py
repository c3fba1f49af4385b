"""The sections of the two methods and what they share: ``diloco`` (Decoupled DiLoCo: learners,
quorum, grace window, fragments, outer optimizer, wire format), ``dp`` (the data-parallel baseline),
their inner optimizer, ``train`` (budgets and measurement) and ``network`` (the modelled links the
report prices communication on)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from configs.base import _Strict


class InnerOptConfig(_Strict):
    """AdamW (or SGD) with linear warmup then cosine decay to ``final_lr_frac`` × lr."""

    name: Literal["adamw", "sgd"] = Field("adamw", description="inner optimizer")
    lr: PositiveFloat = Field(3e-3, description="peak learning rate")
    warmup_steps: int = Field(20, ge=0, description="linear warmup, steps")
    final_lr_frac: float = Field(0.1, ge=0.0, le=1.0, description="cosine decay ends at this fraction of lr")
    weight_decay: float = Field(0.1, ge=0.0, description="decoupled weight decay (AdamW)")
    b1: float = Field(0.9, ge=0.0, lt=1.0, description="Adam β1")
    b2: float = Field(0.95, ge=0.0, lt=1.0, description="Adam β2")
    grad_clip: float = Field(1.0, ge=0.0, description="global-norm clip; 0 disables")


class WireConfig(_Strict):
    """How learners send their fragments to the syncer (``diloco/wire.py``). float32 sends the
    learner's parameters θ exactly; bfloat16, int8 and int4 send its update Δ = θ − Θ (against the
    global fragment it last received) rounded to that type, int8 and int4 with symmetric absmax
    scales per tensor or per block. The syncer publishes float32 whatever this says."""

    dtype: Literal["float32", "bfloat16", "int8", "int4"] = Field(
        "float32",
        description="what learners send the syncer: float32 (θ exactly, 4 bytes a value), "
        "bfloat16 (Δ rounded to bfloat16, 2 bytes), int8 (Δ as codes in [−127, 127] times a float32 scale, "
        "about 1 byte) or int4 (codes in [−7, 7], two per byte, about ½ byte); Δ = θ − the global fragment "
        "last received. Publishing (syncer to learners) stays float32",
    )
    block_size: PositiveInt | None = Field(
        None,
        description="int8/int4: values per scale (a float32 absmax scale per block of this many values "
        "of a tensor: a smaller block is more precise and costs 4 bytes a block); unset = one scale per tensor",
    )

    @model_validator(mode="after")
    def _check_block(self) -> WireConfig:
        if self.block_size is not None and self.dtype not in ("int8", "int4"):
            raise ValueError(f"diloco.wire.block_size applies to int8 and int4 only, not {self.dtype}; unset it")
        return self

    @property
    def spec(self) -> str:
        """The wire format's name in submissions and reports (``diloco.wire.WireFormat.spec``):
        ``int4`` or ``int4:64``."""
        return self.dtype if self.block_size is None else f"{self.dtype}:{self.block_size}"


class DiLoCoConfig(_Strict):
    """Decoupled DiLoCo: M learners, P fragments, period H, quorum K, grace window (fixed or adaptive).

    Defaults follow DiLoCo (arXiv 2311.08105) and Decoupled DiLoCo (arXiv 2604.21428); where the papers
    are silent the value is ours (see the README).
    """

    enabled: bool = Field(
        True,
        description="train Decoupled DiLoCo (false: the DP baseline only, e.g. a tuning "
        "trial of DP's settings; dp.enabled must then be true)",
    )
    learners: PositiveInt = Field(4, description="M, number of learners")
    fragments: PositiveInt = Field(4, description="P, number of parameter fragments")
    sync_every: PositiveInt = Field(32, description="H, inner steps between two sends of a fragment")
    quorum: PositiveInt = Field(3, description="K, minimum distinct learners before a merge")
    grace_s: float = Field(
        3.0,
        ge=0.0,
        description="fixed grace window after quorum, seconds (with "
        "diloco.grace adaptive: the window until enough step times are measured)",
    )
    grace: Literal["fixed", "adaptive"] = Field(
        "fixed",
        description="grace window after quorum: fixed (diloco.grace_s) or adaptive (the paper's "
        "Eq. 3: clamp(γ·(τ·t_step − t_quorum − t_sync), 0, cap), measured online)",
    )
    grace_gamma: PositiveFloat = Field(
        0.5,
        le=1.0,
        description="γ of the adaptive grace window: the share of the measured slack the syncer "
        "waits (the paper does not publish its value; 0.5 is ours)",
    )
    grace_overlap_steps: PositiveInt | None = Field(
        None,
        description="τ of the adaptive grace window: inner steps a fragment's round trip may take "
        "without costing a learner anything; unset = diloco.overlap_steps, or H (diloco.sync_every: the "
        "merged fragment is due before the learner sends that fragment again)",
    )
    grace_cap_s: float | None = Field(
        None, ge=0.0, description="cap of the adaptive grace window, seconds; unset = one measured inner step"
    )
    merge: Literal["mean", "token_weighted", "rda"] = Field(
        "token_weighted",
        description="merge rule: mean, token_weighted (w = tokens²/steps) or rda (radial-directional averaging)",
    )
    outer_lr: PositiveFloat = Field(0.7, description="outer SGD learning rate")
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="outer SGD momentum μ; 0 = plain SGD")
    outer_nesterov: bool = Field(True, description="Nesterov momentum in the outer step (with μ > 0)")
    receipt: Literal["overwrite", "mix", "keep_in_flight"] = Field(
        "overwrite",
        description="what a learner does with its fragment when a newer global one "
        "arrives: overwrite (θ ← Θ, the paper), mix (θ ← α·θ_local + (1−α)·Θ, diloco.mix_alpha) or "
        "keep_in_flight (θ ← Θ + (θ_local − θ_sent): keep the steps taken while it was in flight)",
    )
    mix_alpha: float = Field(0.5, gt=0.0, lt=1.0, description="α of the mix receipt rule")
    compute_slots: int = Field(
        1,
        ge=0,
        description="learners on one host step in first-come turns, at most this many at "
        "once (threads of one process, or the learner processes of one host on Ray/Dask); 0 = "
        "unpaced (the OS scheduler decides, and co-located learners drift apart); set it to the "
        "number of learners that have their own devices on a host (threads on accelerators: the "
        "turns are per device slice already, learners on different GPUs never wait for each other)",
    )
    max_staleness: int = Field(
        1, ge=0, description="merge a late submission at most this many versions behind; else drop"
    )
    overlap_steps: PositiveInt | None = Field(
        None,
        description="τ: a fragment a learner sent must be merged back within this many of its inner steps, "
        "or the learner waits for it (the paper's overlapped communication: waiting is lost goodput); unset = "
        "never wait (merges are applied whenever they arrive)",
    )
    wire: WireConfig = WireConfig()
    heartbeat_timeout_s: PositiveFloat = Field(
        10.0, description="a learner silent this long is treated as down by the syncer"
    )
    warn_dropped_fraction: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="warn (log and report) when more than this fraction of the "
        "learners' processed tokens was dropped by the syncer (non-finite, stale, superseded, ...)",
    )
    max_dropped_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="the run fails (non-zero exit, after the report is written) "
        "when more than this fraction of the learners' processed tokens was dropped",
    )
    batch_size: PositiveInt = Field(8, description="sequences per learner inner step")
    inner: InnerOptConfig = InnerOptConfig()
    learner_retries: int = Field(2, ge=0, description="Prefect retries for each learner task")
    resume_every_steps: int = Field(
        100,
        ge=0,
        description="a learner saves its resume point (local step, data cursor, tokens, "
        "inner optimizer state; Orbax, ~0.15 s for the default model on 2 CPU cores) every this many "
        "inner steps, so a retry, in this process or a fresh one, resumes there with its Adam moments; "
        "0 = never (a retry starts again at step 0 with a fresh optimizer)",
    )
    retry_delay_s: float = Field(
        3.0, ge=0.0, description="seconds before Prefect retries a failed learner or syncer task"
    )
    syncer_retries: int = Field(
        2,
        ge=0,
        description="Prefect retries for the syncer task with runtime.exchange fsspec: a retry takes "
        "office (fencing out the failed attempt), loads the newest syncer checkpoint and replays the journal "
        "after it, losing and repeating no merge; the in-process exchange's syncer is not retried",
    )
    syncer_checkpoint_every_s: float = Field(
        30.0,
        ge=0.0,
        description="with runtime.exchange fsspec, the syncer checkpoints its state (global "
        "fragments, outer momentum, versions, token ledger; Orbax in pretrain/diloco/syncer/) every this many "
        "seconds and at the end; submissions and journal entries are deleted once two checkpoints cover them, "
        "so this also bounds the exchange's storage; 0 = only at the end",
    )

    @model_validator(mode="after")
    def _check(self) -> DiLoCoConfig:
        if self.quorum > self.learners:
            raise ValueError(f"diloco.quorum (K={self.quorum}) must be ≤ diloco.learners (M={self.learners})")
        if self.warn_dropped_fraction > self.max_dropped_fraction:
            raise ValueError(
                f"diloco.warn_dropped_fraction ({self.warn_dropped_fraction}) must be ≤ "
                f"diloco.max_dropped_fraction ({self.max_dropped_fraction})"
            )
        return self


class DPConfig(_Strict):
    """The data-parallel baseline: one synchronous (SPMD) job, in the flow's process (``hosts`` 1: its
    ``workers`` replicas are counted, not run) or as ``hosts`` JAX processes joined by ``jax.distributed``
    (``training.dp_job``: each host a replica, the gradients all-reduced by XLA's collectives)."""

    inner: InnerOptConfig = InnerOptConfig()
    batch_size: PositiveInt = Field(32, description="global batch: sequences per DP step (all replicas together)")
    workers: PositiveInt = Field(
        4,
        description="data-parallel replicas the global batch is split over; sets the all-reduce "
        "bytes the report counts (a ring all-reduce per step); with dp.hosts > 1 the hosts are the "
        "replicas and this must equal dp.hosts",
    )
    hosts: PositiveInt = Field(
        1,
        description="JAX processes the job runs as, one per host, joined by jax.distributed (gradients "
        "all-reduced by XLA's collectives: gloo on CPU, NCCL on GPU), each taking dp.batch_size / hosts rows "
        "of every step; started as tasks on runtime.engine (local processes on threads). 1 = one process, "
        "the flow's",
    )
    restarts: int | None = Field(
        3,
        ge=0,
        description="times the job restarts every host from its last checkpoint after a host dies unscheduled "
        "(a crash, a kill by hand, a lost node: an elastic launcher's max restarts); one more such death fails "
        "the stage; scheduled failures (dp_fail events, the chaos schedule) always restart it; unset = no limit",
    )
    enabled: bool = Field(True, description="train the DP baseline (false: DiLoCo only)")
    checkpoint_every_steps: PositiveInt | None = Field(
        None,
        description="DP saves a checkpoint (Orbax: parameters, optimizer state, data cursor) every this many "
        "steps; a restarted job resumes from the last one; unset = every 50 steps when the chaos "
        "schedule or a dp_fail event fails DP or dp.hosts > 1, else never",
    )

    @model_validator(mode="after")
    def _check_hosts(self) -> DPConfig:
        if self.hosts > 1 and self.workers != self.hosts:
            raise ValueError(
                f"dp.workers ({self.workers}) must equal dp.hosts ({self.hosts}): with several hosts each "
                f"host is a replica; set dp.workers {self.hosts}"
            )
        if self.batch_size % self.hosts:
            raise ValueError(
                f"dp.batch_size ({self.batch_size}) must be divisible by dp.hosts ({self.hosts}): every "
                f"host takes an equal share of each step's rows; pick a multiple of {self.hosts}"
            )
        return self


class TrainConfig(_Strict):
    """Budgets and measurement shared by both methods, in the data's unit: tokens for text, images
    for vision (the field names say tokens for both)."""

    token_budget: PositiveInt = Field(
        2_097_152, description="training budget per method: tokens (text) or images (vision)"
    )
    eval_every_tokens: PositiveInt = Field(262_144, description="held-out loss cadence, in the budget's unit")
    eval_batches: PositiveInt = Field(8, description="fixed validation batches per measurement")
    eval_batch_size: PositiveInt = Field(16, description="sequences per held-out batch")
    microbatch_size: PositiveInt | None = Field(
        None,
        description="sequences per forward/backward pass; a step averages the gradients of "
        "its microbatches (same update, smaller activations); must divide diloco.batch_size; "
        "unset = the whole batch at once",
    )


class NetworkConfig(_Strict):
    """The network between workers: each DP replica and each DiLoCo learner on its own host, one
    full-duplex link each. The report models time under it (``reports/interconnect.py``); with
    ``emulate`` the runs also train across such links on this machine (``run.netem``) and their times
    and bytes are measured."""

    label: str = Field(
        "links between datacenters", max_length=80, description="what the links model, named in every modelled figure"
    )
    bandwidth_gbps: PositiveFloat | None = Field(
        1.0,
        description="each link's bandwidth, Gbit/s each way; null = every worker on this host (no "
        "network: the modelled figures are the measured ones)",
    )
    latency_ms: float = Field(20.0, ge=0.0, description="one-way latency of each message, milliseconds")
    emulate: bool = Field(
        False,
        description="train across emulated datacenters: each DiLoCo learner and each DP host runs as a "
        "process in a network namespace of its own, the syncer and the exchange's store (moto's S3 server) in "
        "this host's, joined by veth links shaped with tc to bandwidth_gbps each way (null: unshaped); "
        "latency is not emulated (no netem in this kernel). Needs root, iproute2 and util-linux, "
        "runtime.engine threads and, with DP, dp.hosts > 1",
    )
    dp_overlap: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="share of a DP step's compute that hides its all-reduce (0: the "
        "all-reduce follows the backward pass)",
    )
