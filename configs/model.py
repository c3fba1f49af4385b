"""The ``model`` section: dense and mixture-of-experts decoder LMs and ViTs, one pydantic class per
``model.kind``, told apart by the ``kind`` discriminator (``ModelConfig``)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (
    Discriminator,
    Field,
    PositiveFloat,
    PositiveInt,
    Tag,
    model_validator,
)

from configs.base import _Strict


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
