"""Vision transformers: the ViT (``kind: vit``; Dosovitskiy et al. 2021) and the V-MoE
(``kind: vit_moe``; Riquelme et al. 2021), built from the LM's layers.

An image ``[H, W, C]`` is cut into non-overlapping P×P patches (row-major), each flattened and
projected to D (the patch embedding: a linear map, as the ViT paper's); a learned class token is
prepended (``pool: cls``) or the patch outputs are averaged (``pool: mean``). The blocks are the
LM's pre-norm blocks with bidirectional attention; positions enter through the attention's RoPE
over the token order (the class token first, then the patches row by row) instead of learned
absolute embeddings. V-MoE puts the MoE layer in place of the MLP of every ``moe_every``-th block
(every other block in the paper). A final RMSNorm and a linear head give the class logits.

Pixels arrive as stored (uint8 0-255, or digits' 0-16) and are scaled to [0, 1] by the model's
``pixel_scale``.

Shape legend: B batch, H/W/C image height/width/channels, P patch side, T tokens (patches, plus
the class token), D width, K classes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.layers.attention import SelfAttention
from models.layers.block import Block
from models.layers.lora import project
from models.layers.mlp import SwiGLU
from models.layers.moe import auxiliary_loss, collect_stats, idle_expert_params, mlp_factory, moe_blocks
from models.spec import BatchLayout, InputShape, ModelSpec, count_params, register
from models.text.moe import moe_metrics


def patchify(images_BHWC: jax.Array, patch: int) -> jax.Array:
    """Non-overlapping ``patch × patch`` patches, row-major: ``[B, H, W, C] -> [B, (H/P)(W/P), P·P·C]``.

    Each patch is flattened in (row, column, channel) order. Raises ``ValueError`` unless P divides
    H and W.
    """
    B, H, W, C = images_BHWC.shape
    if H % patch or W % patch:
        raise ValueError(f"patch size {patch} must divide the image's height {H} and width {W}")
    x = images_BHWC.reshape(B, H // patch, patch, W // patch, patch, C)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(B, (H // patch) * (W // patch), patch * patch * C)


class ViT(nnx.Module):
    """``__call__(images: [B, H, W, C] any numeric dtype) -> logits float32[B, K]``.

    ``cfg``: ``configs.model.ViTConfig`` (d_model, n_layers, n_heads, d_ff, patch_size, pool,
    rope_theta). ``make_mlp(i)``: block i's feed-forward layer (default SwiGLU of width d_ff).
    Parameters: ``patch/kernel [P·P·C, D]``, ``patch/bias [D]``, ``cls [1, 1, D]`` (pool ``cls``),
    ``blocks/<i>/…``, ``final_norm/scale``, ``head/kernel [D, K]``, ``head/bias [K]``.
    """

    def __init__(
        self,
        cfg,
        image_shape: tuple[int, int, int],
        num_classes: int,
        rngs: nnx.Rngs,
        make_mlp: Callable[[int], nnx.Module] | None = None,
        pixel_scale: float = 1.0 / 255.0,
    ):
        H, W, C = image_shape
        d, P = cfg.d_model, cfg.patch_size
        if H % P or W % P:
            raise ValueError(f"model.patch_size ({P}) must divide the images' height {H} and width {W}")
        self.patch_size, self.pool, self.pixel_scale = P, cfg.pool, pixel_scale
        make_mlp = make_mlp or (lambda i: SwiGLU(d, cfg.d_ff, cfg.n_layers, rngs))
        self.patch = nnx.Linear(P * P * C, d, kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((1, 1, d), jnp.float32)) if cfg.pool == "cls" else None
        self.blocks = nnx.List(
            [
                Block(
                    d,
                    partial(SelfAttention, d, cfg.n_heads, cfg.n_layers, cfg.rope_theta, False, rngs),
                    partial(make_mlp, i),
                    rngs,
                )
                for i in range(cfg.n_layers)
            ]
        )
        self.final_norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, num_classes, kernel_init=nnx.initializers.zeros_init(), rngs=rngs)

    def features(self, images_BHWC: jax.Array) -> jax.Array:
        """The pooled, final-normed representation ``float32[B, D]``."""
        # pixels scaled in float32, then in the compute dtype (the parameters' dtype as the step cast them)
        x = patchify(images_BHWC.astype(jnp.float32) * self.pixel_scale, self.patch_size)
        x = x.astype(self.final_norm.scale[...].dtype)
        x_BTD = project(self.patch, x)
        if self.cls is not None:
            x_BTD = jnp.concatenate([jnp.broadcast_to(self.cls[...], (x_BTD.shape[0], 1, x_BTD.shape[2])), x_BTD], 1)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        x_BTD = self.final_norm(x_BTD)
        return x_BTD[:, 0] if self.cls is not None else x_BTD.mean(axis=1)

    def __call__(self, images_BHWC: jax.Array) -> jax.Array:
        return project(self.head, self.features(images_BHWC))


def classification_objective(moe_cfg=None, moe_blocks: list[int] | None = None):
    """``objective(model, {"image", "label"}) -> (loss, metrics)``: mean softmax cross entropy over
    the batch (nats per image) plus, for V-MoE, the weighted load-balancing and z losses averaged
    over its MoE layers (as the MoE LM's: :func:`models.layers.moe.auxiliary_loss`; every patch is
    a real token, so no mask). Metrics: ``ce``, ``accuracy`` (top-1, fraction of the batch) and, for
    V-MoE, the MoE layers' (``models.text.moe.moe_metrics``)."""

    def objective(model, batch):
        if moe_cfg is None:
            logits, stats = model(batch["image"]), []
        else:
            logits, intermediates = nnx.capture(model, nnx.Intermediate)(batch["image"])
            stats = collect_stats(intermediates)
        logits = logits.astype(jnp.float32)  # the loss in float32 whatever the compute dtype
        labels = batch["label"].astype(jnp.int32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        metrics = {"ce": ce, "accuracy": jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))}
        loss = ce
        if stats:
            loss = ce + auxiliary_loss(moe_cfg, stats)
            metrics.update(moe_metrics(stats, moe_blocks))
        return loss, metrics

    return objective


def _tokens(cfg, image_shape) -> int:
    H, W, _ = image_shape
    return (H // cfg.patch_size) * (W // cfg.patch_size) + (1 if cfg.pool == "cls" else 0)


def flops_per_image(cfg, image_shape: tuple[int, int, int], num_classes: int, moe_blocks: list[int] = ()) -> float:
    """Training FLOPs per image: T·(6·N_block_matmul + 12·n_layers·D·T) + 6·(patch + head matmuls).

    The LM's accounting (Kaplan et al. 2020; bidirectional attention over all T tokens, PaLM App. B)
    applied per token of the image, with the patch embedding counted once per patch and the head
    once per image; MoE blocks count their router and k experts (active FLOPs), as the MoE LM's.
    """
    H, W, C = image_shape
    d, n, P = cfg.d_model, cfg.n_layers, cfg.patch_size
    T, patches = _tokens(cfg, image_shape), (H // P) * (W // P)
    mlp = 0
    for i in range(n):
        if i in moe_blocks:
            f_e = cfg.expert_d_ff or cfg.d_ff
            mlp += d * cfg.n_experts + cfg.top_k * 3 * d * f_e
        else:
            mlp += 3 * d * cfg.d_ff
    per_token = 6.0 * (n * 4 * d * d + mlp) + 12.0 * n * d * T
    return T * per_token + 6.0 * (patches * P * P * C * d + d * num_classes)


def _layout(image_shape) -> BatchLayout:
    return BatchLayout(
        dtype="uint8",
        row_shape=tuple(image_shape),
        unit="images",
        units_per_row=1,
        columns={"image": ("uint8", tuple(image_shape)), "label": ("int32", ())},
    )


def _need_images(kind: str, shape: InputShape) -> tuple[tuple[int, int, int], int]:
    if not shape.image_shape or not shape.num_classes:
        raise ValueError(f"a {kind} needs image data (the data's image_shape and num_classes)")
    return tuple(shape.image_shape), int(shape.num_classes)


@register("vit")
def build_vit(cfg, shape: InputShape) -> ModelSpec:
    """Spec of a :class:`ViT` for images of ``shape.image_shape`` in ``shape.num_classes`` classes.
    Raises ``ValueError`` without them or if the patch size does not divide the images."""
    image_shape, K = _need_images("vit", shape)

    def init(seed: int) -> ViT:
        return ViT(cfg, image_shape, K, nnx.Rngs(seed), pixel_scale=pixel_scale(shape))

    abstract = nnx.eval_shape(lambda: init(0))
    return ModelSpec(
        kind="vit",
        config=cfg,
        init=init,
        objective=classification_objective(),
        batch=_layout(image_shape),
        params=count_params(abstract),
        flops_per_unit=flops_per_image(cfg, image_shape, K),
        heldout="ce",
    )


@register("vit_moe")
def build_vit_moe(cfg, shape: InputShape) -> ModelSpec:
    """Spec of a V-MoE: a :class:`ViT` whose :func:`models.layers.moe.moe_blocks` hold :class:`models.layers.moe.MoE`
    layers (each image is one routing group). ``extras``: ``active_params``, ``total_params``,
    ``moe_layers``. Raises as :func:`build_vit`."""
    image_shape, K = _need_images("vit_moe", shape)
    blocks = moe_blocks(cfg)

    def init(seed: int) -> ViT:
        rngs = nnx.Rngs(seed)
        return ViT(cfg, image_shape, K, rngs, make_mlp=mlp_factory(cfg, rngs), pixel_scale=pixel_scale(shape))

    total = count_params(nnx.eval_shape(lambda: init(0)))
    active = total - idle_expert_params(cfg)
    return ModelSpec(
        kind="vit_moe",
        config=cfg,
        init=init,
        objective=classification_objective(cfg, blocks),
        batch=_layout(image_shape),
        params=total,
        flops_per_unit=flops_per_image(cfg, image_shape, K, blocks),
        heldout="ce",
        extras={"active_params": active, "total_params": total, "moe_layers": blocks},
    )


def pixel_scale(shape: InputShape) -> float:
    """1 / the data's largest pixel value (``InputShape.pixel_max``: 255 for 8-bit images, 16 for digits)."""
    return 1.0 / (shape.pixel_max or 255)
