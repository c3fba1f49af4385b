"""The inner optimizer of every method: AdamW or SGD with warmup, cosine decay and clipping."""

from __future__ import annotations

import optax


def lr_schedule(cfg, total_steps: int) -> optax.Schedule:
    """Linear warmup over ``warmup_steps`` then cosine decay to ``final_lr_frac``·lr at ``total_steps``.

    ``cfg``: a ``configs.methods.InnerOptConfig``. Steps are optimizer updates (inner steps).
    """
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else cfg.lr,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.lr * cfg.final_lr_frac,
    )


def make_inner_tx(cfg, total_steps: int) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay, Loshchilov & Hutter 2019) or SGD, with global-norm clipping.

    Build it once per run and share it between learners: the step is compiled per optimizer object.
    """
    schedule = lr_schedule(cfg, total_steps)
    if cfg.name == "adamw":
        core = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    else:
        core = optax.sgd(schedule)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), core) if cfg.grad_clip > 0 else core
