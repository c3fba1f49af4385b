"""Fine-tuning a pretrained checkpoint: one recipe, applied identically to every method's model.

The recipe (``cfg.finetune``) fixes the task's rows, their order (a seeded permutation per epoch,
:func:`batch_order`), the optimizer (AdamW with warmup and cosine decay, ``training.optimizers``),
the steps and the seeds; nothing in it depends on the checkpoint, so the DiLoCo- and the
DP-pretrained models see the same examples in the same order (``order_sha256`` in the summary).

Modes: ``full`` trains every parameter; ``lora`` wraps the projections of ``finetune.lora_targets``
in Flax NNX LoRA layers (``models.layers.lora``, scale ``finetune.lora_alpha`` / ``finetune.lora_rank``)
and trains only the adapters (and a new head), the base weights passed to the step as frozen inputs,
never differentiated. A vision task with its own label set gets a new head (``num_classes`` of the
task, zero-initialised by the model), every other parameter starts from the checkpoint. The
fine-tuned checkpoint holds the plain model's parameters (adapters folded in, scaled by α/r), so it
loads like any other; a LoRA run also writes the adapters alone (:func:`save_adapters`,
:func:`load_adapters`).

The loss of a step is the mean over every target token of its batch (response tokens and their
closing EOT; ``data.finetune.pack_rows``), whatever ``train.microbatch_size`` splits it into
(``training.step.make_train_step`` with the spec's target count). A batch without a target token is
never trained on: it is skipped and counted (``skipped_empty_batches``), and a task whose rows hold
no target at all is refused.

Writes ``RUN/finetune/<method>/`` (``checkpoints/<step>`` for the first seed, ``seeds/<s>/checkpoints``
for the others, LoRA's ``adapters/<step>`` beside each, ``metrics/{train,eval}.jsonl``,
``summary.json``). No Prefect here.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.data import DataConfig
from configs.eval import EvalConfig
from configs.finetune import FinetuneConfig
from configs.model import ModelConfig
from configs.runtime import PrecisionConfig, RuntimeConfig
from configs.schema import ExperimentConfig
from data.finetune import load_finetune_rows
from data.store import load_manifest
from models import InputShape, ModelSpec, build_model
from models.layers.lora import adapted_layers, add_lora, is_adapter, merge_lora
from run.control import STOP
from run.layout import PAIRS_FILE
from run.metrics import JsonlWriter
from training.checkpoint import CheckpointError, load_extra, load_into_model, load_meta, save_checkpoint
from training.common import model_spec
from training.evaluation import heldout_metrics
from training.functional import Functional, flatten, load_params, nest, params_of
from training.optimizers import lr_schedule, make_inner_tx
from training.precision import cast_floating, dtypes, set_compute_dtype, wrap_optimizer
from training.step import make_eval_step, make_train_step

LOG_EVERY = 5  # steps between two train-log lines
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinetunePlan:
    """What fine-tuning and its evaluation read of a run's config: the pretrained ``model`` (built
    for ``data`` with ``runtime.compilation_cache``, initialised with ``seed`` before its checkpoint
    is loaded), the recipe (``finetune``), the ``precision`` policy, ``train.microbatch_size`` (rows
    per forward/backward pass; None: the whole batch) and ``eval`` (batch size, the lm-eval tasks)."""

    model: ModelConfig
    data: DataConfig
    runtime: RuntimeConfig
    seed: int
    finetune: FinetuneConfig
    precision: PrecisionConfig
    microbatch_size: int | None
    eval: EvalConfig

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> FinetunePlan:
        """``cfg``'s plan: each field the config's section of that name, but ``train.microbatch_size``."""
        own = {"microbatch_size": cfg.train.microbatch_size}
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if f.name not in own}, **own)

    def pretrained_spec(self, run_dir: str | Path) -> ModelSpec:
        """The pretrained model's spec (``training.common.model_spec``)."""
        return model_spec(self.model, self.data, self.runtime, run_dir)


def finetune_spec(plan: FinetunePlan, run_dir: str | Path, task: Mapping[str, Any]) -> ModelSpec:
    """The model to fine-tune: the pretrained model's spec, or for an image task with its own label
    set the same model with a head of ``task["num_classes"]`` classes."""
    if plan.data.modality != "image":
        return plan.pretrained_spec(run_dir)
    m = load_manifest(run_dir)
    shape = InputShape(
        image_shape=tuple(m["image_shape"]), num_classes=int(task["num_classes"]), pixel_max=int(m["pixel_max"])
    )
    return build_model(plan.model, shape)


def load_pretrained(
    plan: FinetunePlan, run_dir: str | Path, checkpoint: str | Path, spec: ModelSpec, seed: int
) -> tuple[nnx.Module, list[str], dict]:
    """``spec``'s model (initialised with ``seed``) holding the checkpoint's parameters wherever name
    and shape agree: ``(model, fresh parameter names, checkpoint meta)``. ``fresh`` lists the
    parameters that keep their initialisation (a new head).

    Raises ``training.checkpoint.CheckpointError`` for a missing, incomplete or mismatched checkpoint,
    and ``ValueError`` when a parameter other than the head would start fresh.
    """
    source = plan.pretrained_spec(run_dir).init(plan.seed)
    meta = load_into_model(checkpoint, source)
    pretrained = params_of(source)
    model = spec.init(seed)
    target = params_of(model)
    fits = {k: v for k, v in pretrained.items() if k in target and target[k].shape == v.shape}
    fresh = sorted(set(target) - set(fits))
    if any(not k.startswith("head/") for k in fresh):
        raise ValueError(f"the checkpoint {checkpoint} does not fit the model: {fresh[:3]} would start fresh")
    load_params(model, fits)
    return model, fresh, meta


def batch_order(n_rows: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """Row indices of every step, ``int64[steps, batch_size]``: epochs of a permutation seeded by
    ``(seed, epoch)``, read in order; a batch may span two epochs. Depends only on its arguments."""
    need = steps * batch_size
    out, epoch = [], 0
    while sum(len(o) for o in out) < need:
        out.append(np.random.default_rng([seed, epoch]).permutation(n_rows))
        epoch += 1
    return np.concatenate(out)[:need].reshape(steps, batch_size)


def order_digest(order: np.ndarray) -> str:
    """sha256 of the row order (hex, first 16 characters): equal digests, equal examples and order."""
    return hashlib.sha256(np.ascontiguousarray(order, dtype=np.int64).tobytes()).hexdigest()[:16]


def _batches(rows: Mapping[str, np.ndarray], batch_size: int) -> list[dict]:
    """Fixed evaluation batches of the test rows (every row; the last batch padded by repeating its
    first row would bias the mean, so the remainder is dropped when there is at least one batch)."""
    n = len(next(iter(rows.values())))
    size = min(batch_size, n)
    return [{k: v[i : i + size] for k, v in rows.items()} for i in range(0, n - size + 1, size)]


def finetune_run(
    plan: FinetunePlan,
    run_dir: str | Path,
    checkpoint: str | Path,
    data_dir: str | Path,
    task: Mapping[str, Any],
    seed: int,
    *,
    train_log: Callable[[dict], None] | None = None,
    eval_log: Callable[[dict], None] | None = None,
    keep_params: bool = False,
) -> dict:
    """One fine-tuning run of ``checkpoint`` with seed ``seed``; returns its record.

    Record: ``seed``, ``steps`` (taken; fewer after a stop signal), ``examples``, ``wall_s``,
    ``final_train_loss``, ``final_val_loss`` (nats per target token: response tokens and their
    closing EOT, or per image, on the task's test rows), ``order_sha256``, ``trainable_params``,
    ``frozen_params``, ``fresh`` (new parameters), ``adapted`` (LoRA layers), ``lora_alpha`` (α, LoRA
    only), ``skipped_empty_batches`` (batches without a target token: no step taken on them),
    ``params`` (flat, the plain model's layout), ``trained`` (the trained flat parameters as
    trained: adapters unmerged, and a new head) and, with ``keep_params``, ``state`` (the same) and
    ``frozen`` (the frozen ones).

    Raises ``ValueError`` when no train row holds a target token (nothing to learn).
    """
    ft = plan.finetune
    spec = finetune_spec(plan, run_dir, task)
    fn, params, frozen, fresh, adapted, compute = _finetune_model(plan, run_dir, checkpoint, spec, seed)
    tx = wrap_optimizer(make_inner_tx(ft.optimizer, ft.steps), plan.precision)
    lr = lr_schedule(ft.optimizer, ft.steps)
    mb = plan.microbatch_size
    step_fn = make_train_step(
        fn, spec.objective, tx, ft.batch_size // mb if mb else 1, compute_dtype=compute, targets=spec.count_targets
    )
    evaluate = make_eval_step(fn, spec.objective, spec.heldout, compute_dtype=compute, targets=spec.count_targets)
    opt_state = tx.init(params)
    rows, test, order = _finetune_data(data_dir, spec, ft, seed)

    def val_loss() -> float:
        return heldout_metrics(lambda p, b: evaluate(p, b, frozen), params, test)["loss"]

    t0 = time.monotonic()
    last_val = val_loss()
    if eval_log:
        eval_log({"seed": seed, "step": 0, "examples": 0, "val/loss": last_val})
    loss = float("nan")
    done = skipped = 0
    metrics = None
    for i in range(ft.steps):
        if STOP.is_set():
            break
        batch = {k: jnp.asarray(v[order[i]]) for k, v in rows.items()}
        done = i + 1
        if float(spec.count_targets({k: v[order[i]] for k, v in rows.items()})) == 0:
            skipped += 1  # no target token: a step would train on a loss of 0 (weight decay, momentum)
            log.warning("fine-tuning seed %d: batch %d holds no target token; skipped (no optimizer step)", seed, done)
        else:
            params, opt_state, metrics = step_fn(params, opt_state, batch, frozen)
        if (done % LOG_EVERY == 0 or done == ft.steps) and metrics is not None:
            loss = float(metrics["loss"])
            if train_log:
                train_log(_train_row(seed, done, ft.batch_size, loss, metrics, float(lr(done - skipped - 1)), t0))
        if done % ft.eval_every_steps == 0 or done == ft.steps:
            last_val = val_loss()
            if eval_log:
                eval_log({"seed": seed, "step": done, "examples": done * ft.batch_size, "val/loss": last_val})
    if done and done % ft.eval_every_steps and done != ft.steps:  # stopped part-way
        last_val = val_loss()
    trained = {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}  # (float32 whatever the policy)
    record = {
        "seed": seed,
        "steps": done,
        "examples": done * ft.batch_size,
        "wall_s": time.monotonic() - t0,
        "final_train_loss": loss,
        "final_val_loss": last_val,
        "order_sha256": order_digest(order[:done]),
        **_parameter_record(ft, trained, frozen, fresh, adapted, skipped),
    }
    if keep_params:
        record["state"] = trained
        record["frozen"] = {k: np.asarray(v, dtype=np.float32) for k, v in frozen.items()}
    return record


def _finetune_data(data_dir, spec, ft, seed: int):
    """The train rows, the test batches and the seed's batch order; ``ValueError`` when no train row
    holds a target token."""
    rows = load_finetune_rows(data_dir, "train")
    if float(spec.count_targets(rows)) == 0:
        raise ValueError(
            f"the fine-tuning rows in {data_dir} hold no target token (every response mask is 0): "
            "nothing to learn; prepare the fine-tuning data again (finetune.source, finetune.seq_len)"
        )
    test = _batches(load_finetune_rows(data_dir, "test"), ft.batch_size)
    n_rows = len(next(iter(rows.values())))
    order = batch_order(n_rows, ft.batch_size, ft.steps, seed)
    return rows, test, order


def _finetune_model(plan: FinetunePlan, run_dir, checkpoint, spec, seed: int):
    """The pretrained model for fine-tuning (LoRA added in ``lora`` mode, the precision policy
    applied): ``(fn, params, frozen, fresh, adapted, compute_dtype)``, params the trainable flat
    parameters and frozen the rest."""
    ft = plan.finetune
    model, fresh, _ = load_pretrained(plan, run_dir, checkpoint, spec, seed)
    adapted = (
        add_lora(model, ft.lora_rank, ft.lora_targets, nnx.Rngs(seed), alpha=ft.lora_alpha) if ft.mode == "lora" else []
    )
    policy = dtypes(plan.precision)  # as in pretraining: parameters, compute and optimizer-state dtypes
    compute = None if policy is None else policy.compute
    set_compute_dtype(model, compute)
    fn, flat = Functional.of(model)
    if policy is not None:
        flat = cast_floating(flat, policy.params)
    trainable = {k for k in flat if ft.mode == "full" or is_adapter(k) or k in fresh}
    params = {k: v for k, v in flat.items() if k in trainable}
    frozen = {k: v for k, v in flat.items() if k not in trainable}
    return fn, params, frozen, fresh, adapted, compute


def _train_row(seed: int, done: int, batch_size: int, loss: float, metrics: Mapping, lr: float, t0: float) -> dict:
    """The ``train_log`` row after ``done`` steps of ``batch_size`` rows (``lr``: the last update's rate)."""
    return {
        "seed": seed,
        "step": done,
        "examples": done * batch_size,
        "train/loss": loss,
        **{f"train/{k}": float(v) for k, v in metrics.items() if k != "loss"},
        "train/lr": lr,
        "t": time.monotonic() - t0,
    }


def _parameter_record(ft, trained: dict, frozen: dict, fresh, adapted, skipped: int) -> dict:
    """The parameter part of :func:`finetune_run`'s record: counts, LoRA layers and the merged ``params``."""
    alpha = float(ft.lora_alpha or ft.lora_rank)
    return {
        "trainable_params": int(sum(v.size for v in trained.values())),
        "frozen_params": int(sum(np.size(v) for v in frozen.values())),
        "fresh": fresh,
        "adapted": adapted,
        "lora_alpha": alpha if adapted else None,
        "skipped_empty_batches": skipped,
        "params": {
            k: np.asarray(v, dtype=np.float32)
            for k, v in merge_lora({**frozen, **trained}, scale=alpha / ft.lora_rank).items()
        },
        "trained": trained,
    }


def save_finetuned(ckpt_dir: str | Path, record: Mapping[str, Any], meta: Mapping[str, Any]) -> Path:
    """Write a fine-tuned model (``record["params"]``, the plain layout) as an Orbax checkpoint at
    step = optimizer steps taken; returns the step folder (never overwrites one)."""
    return save_checkpoint(
        ckpt_dir,
        int(record["steps"]),
        nest(record["params"]),
        {**meta, "steps": record["steps"], "seed": record["seed"]},
    )


def save_adapters(ckpt_dir: str | Path, record: Mapping[str, Any], ft: FinetuneConfig, meta: Mapping[str, Any]) -> Path:
    """Write a LoRA run's adapters alone (``record["trained"]``: every ``lora_a``/``lora_b`` and a new
    head) as an Orbax checkpoint at step = optimizer steps taken, beside the merged model
    (``run.layout.RunLayout.adapters``); returns the step folder. Meta: ``meta`` plus ``lora_rank``,
    ``lora_alpha`` (α; the adapters enter scaled by α/r), ``lora_targets``, ``adapted`` (layer paths),
    ``fresh``, ``steps``, ``seed``; ``ft``: the recipe. Raises ``FileExistsError`` for an existing step."""
    return save_checkpoint(
        ckpt_dir,
        int(record["steps"]),
        nest(dict(record["trained"])),
        {
            **meta,
            "lora_rank": ft.lora_rank,
            "lora_alpha": float(ft.lora_alpha or ft.lora_rank),
            "lora_targets": list(ft.lora_targets),
            "adapted": list(record["adapted"]),
            "fresh": list(record["fresh"]),
            "steps": record["steps"],
            "seed": record["seed"],
        },
    )


def load_adapters(ckpt_dir: str | Path, model: nnx.Module, step: int | None = None) -> dict:
    """Load adapters written by :func:`save_adapters` into ``model`` in place (a model already
    adapted with ``models.layers.lora.add_lora``, its base weights loaded); returns their meta.

    Raises ``training.checkpoint.CheckpointError`` when the model has no LoRA layers, when its
    adapted layers differ from the checkpoint's, or when their rank or α differ from the
    checkpoint's (naming both: adapters of another rank do not fit, of another α would compute
    another model), plus the errors of the checkpoint loaders.
    """
    meta = load_meta(ckpt_dir, step)
    layers = adapted_layers(model)
    if not layers:
        raise CheckpointError(
            f"{ckpt_dir} holds LoRA adapters but this model has none; adapt it first "
            f"(add_lora with rank {meta['lora_rank']}, α {meta['lora_alpha']}, "
            f"targets {meta['lora_targets']})"
        )
    for path, layer in layers.items():
        rank = int(layer.lora_a.shape[1])
        alpha = float(getattr(layer, "alpha", rank))
        if rank != int(meta["lora_rank"]) or alpha != float(meta["lora_alpha"]):
            raise CheckpointError(
                f"{ckpt_dir}: the adapters were trained with rank {meta['lora_rank']} "
                f"and α {float(meta['lora_alpha'])} "
                f"(finetune.lora_rank, finetune.lora_alpha); this model's {path} has rank {rank} and α {alpha}; "
                "adapt the model with the checkpoint's rank and α"
            )
    if sorted(layers) != sorted(meta["adapted"]):
        raise CheckpointError(
            f"{ckpt_dir}: the adapters are on {len(meta['adapted'])} layers "
            f"(targets {meta['lora_targets']}), this model adapts {len(layers)}; "
            "adapt it with the checkpoint's finetune.lora_targets"
        )
    own = params_of(model)
    names = [k for k in own if is_adapter(k) or k in set(meta.get("fresh", []))]
    restored = load_extra(ckpt_dir, "params", nest({k: own[k] for k in names}), step)
    load_params(model, flatten(restored))
    return meta


def model_with(spec: ModelSpec, params: Mapping[str, np.ndarray], seed: int = 0) -> nnx.Module:
    """``spec``'s model holding ``params`` (flat, the plain layout)."""
    model = spec.init(seed)
    load_params(model, params)
    return model


def logits_fn(model: nnx.Module) -> Callable[[np.ndarray], np.ndarray]:
    """A jitted ``images uint8[B, H, W, C] -> float32[B, K]`` of an image classifier."""
    fn, params = Functional.of(model)
    run = jax.jit(lambda p, x: fn.module(p)(x))
    return lambda x: np.asarray(run(params, x))


# ----------------------------------------------------------------------------------- one method


def finetune_record(ft: FinetuneConfig, seed: int) -> dict:
    """The recipe as compared between methods: the ``finetune`` section ``ft`` (``enabled`` aside)
    and the run's ``seed``. Two methods of one run directory are compared only under one record. An
    unset ``lora_alpha`` (= the rank) is left out, so a record written before the field existed still
    matches."""
    exclude = {"enabled"} | ({"lora_alpha"} if ft.lora_alpha is None else set())
    return {**ft.model_dump(mode="json", exclude=exclude), "seed": seed}


def recipe_of(ft: FinetuneConfig, task: Mapping[str, Any]) -> dict:
    """The recipe ``ft`` as the summary and the report state it."""
    o = ft.optimizer
    return {
        "task": task["name"],
        "mode": ft.mode,
        "lora_rank": ft.lora_rank if ft.mode == "lora" else None,
        "lora_alpha": float(ft.lora_alpha or ft.lora_rank) if ft.mode == "lora" else None,
        "lora_targets": list(ft.lora_targets) if ft.mode == "lora" else None,
        "steps": ft.steps,
        "batch_size": ft.batch_size,
        "optimizer": o.name,
        "lr": o.lr,
        "warmup_steps": o.warmup_steps,
        "weight_decay": o.weight_decay,
        "seeds": list(ft.seeds),
        "packing": ft.packing if task.get("modality") == "text" else None,
        "row_len": task.get("row_len"),
    }


def finetune_method(
    cfg: ExperimentConfig,
    run_dir: str | Path,
    method: str,
    task: Mapping[str, Any],
    checkpoint: str | Path | None = None,
) -> dict:
    """Fine-tune ``method``'s pretrained model once per seed of ``cfg.finetune.seeds``; returns the
    summary (also written to ``finetune/<method>/summary.json``).

    ``checkpoint``: the Orbax checkpoint folder to start from (default: ``pretrain/<method>/checkpoints``
    of ``run_dir``). The first seed's model goes to ``finetune/<method>/checkpoints``, the others' to
    ``finetune/<method>/seeds/<seed>/checkpoints``; losses to ``finetune/<method>/metrics``. Stops
    after the current step on a stop signal (``run.control.STOP``), saving what it has. Raises
    ``FileExistsError`` when the method already has fine-tuning results, and the errors of
    :func:`load_pretrained`.
    """
    from run import atomic
    from run.layout import RunLayout
    from training.common import ensure_fresh
    from training.tracking import method_tracker

    layout = RunLayout(run_dir)
    ensure_fresh(run_dir, "finetune", method)
    source = Path(checkpoint) if checkpoint else Path(layout.checkpoints("pretrain", method))
    plan = FinetunePlan.of(cfg)
    tracker = method_tracker(cfg, run_dir, "finetune", method)
    train_log = JsonlWriter(layout.metrics("finetune", method, "train"), sink=tracker.sink("train"))
    eval_log = JsonlWriter(layout.metrics("finetune", method, "eval"), sink=tracker.sink("eval"))
    runs = []
    try:
        for i, seed in enumerate(cfg.finetune.seeds):
            if STOP.is_set():
                break
            rec = finetune_run(
                plan, run_dir, source, layout.finetune_data, task, seed, train_log=train_log, eval_log=eval_log
            )
            ckpt = layout.checkpoints("finetune", method, None if i == 0 else seed)
            meta = {
                "method": method,
                "stage": "finetune",
                "source": str(source),
                "task": task["name"],
                "mode": cfg.finetune.mode,
            }
            save_finetuned(ckpt, rec, meta)
            where = {"checkpoint": ckpt}
            if rec["adapted"]:
                where["adapters"] = layout.adapters("finetune", method, None if i == 0 else seed)
                save_adapters(where["adapters"], rec, cfg.finetune, meta)
            rec.pop("params")
            rec.pop("trained")
            runs.append(
                {
                    **rec,
                    **{
                        k: str(Path(p).relative_to(Path(layout.root)))
                        if Path(p).is_relative_to(Path(layout.root))
                        else str(p)
                        for k, p in where.items()
                    },
                }
            )
    finally:
        train_log.close()
        eval_log.close()
        tracker.close()
    summary = {
        "method": method,
        "source_checkpoint": str(source),
        "recipe": recipe_of(cfg.finetune, task),
        "finetune_config": finetune_record(cfg.finetune, cfg.seed),
        "trainable_params": runs[0]["trainable_params"] if runs else None,
        "frozen_params": runs[0]["frozen_params"] if runs else None,
        "interrupted": STOP.is_set(),
        "runs": runs,
    }
    import json

    atomic.write_text(layout.summary("finetune", method), json.dumps(summary, indent=2))
    return summary


def _task_metrics_meta(task: Mapping[str, Any]) -> dict:
    if task["modality"] == "image":
        return {
            "accuracy": {"higher_is_better": True, "label": "accuracy"},
            "loss": {"higher_is_better": False, "label": "loss (nats/image)"},
        }
    return {
        "exact_match": {"higher_is_better": True, "label": "exact match"},
        "response_nll": {"higher_is_better": False, "label": "response NLL (nats/token)"},
    }


def _score(plan: FinetunePlan, run_dir: str | Path, model: nnx.Module, task: Mapping[str, Any], out_dir: Path) -> dict:
    """``{"metrics", "per_item"}`` of ``model`` on the task's test items."""
    from run.layout import RunLayout

    data_dir = RunLayout(run_dir).finetune_data
    if task["modality"] == "image":
        from evals.vision import evaluate_classifier

        out = evaluate_classifier(
            logits_fn(model), load_finetune_rows(data_dir, "test"), int(task["num_classes"]), per_item=True
        )
        return {
            "metrics": {"accuracy": out["test/accuracy"], "loss": out["test/loss"], "items": out["test/images"]},
            "per_item": out["per_item"],
        }
    from data.finetune import read_pairs
    from data.store import load_tokenizer
    from evals.pair_tasks import evaluate_pairs

    res = evaluate_pairs(
        model,
        load_tokenizer(run_dir),
        read_pairs(Path(data_dir) / PAIRS_FILE.format(split="test")),
        out_dir,
        batch_size=plan.eval.batch_size,
        max_gen_toks=max_gen_tokens(plan.finetune, task),
        seed=plan.seed,
    )
    per_item = {k: v for k, v in res["per_item"].items() if k in ("exact_match", "response_nll")}
    return {"metrics": res["metrics"], "per_item": per_item, "generated": res["per_item"].get("generated")}


def max_gen_tokens(ft: FinetuneConfig, task: Mapping[str, Any]) -> int:
    """The generation cap of the exact-match task: ``finetune.max_gen_toks`` (of ``ft``), else the
    task's longest response (tokens, with its newline) + 2."""
    return ft.max_gen_toks or int(task.get("longest_response_tokens", 14)) + 2


def evaluate_finetune(
    plan: FinetunePlan,
    run_dir: str | Path,
    method: str,
    task: Mapping[str, Any],
    checkpoint: str | Path | None = None,
) -> dict:
    """Score ``method`` on the fine-tuning task before (the pretrained checkpoint, with a fresh head
    for a new label set) and after fine-tuning (every seed), and, for text, the pretraining tasks
    again on the first seed's model; writes ``eval/finetune/<method>.json`` and returns it.

    Raises ``training.checkpoint.CheckpointError`` for a missing checkpoint.
    """
    import json

    from run import atomic
    from run.layout import RunLayout

    layout = RunLayout(run_dir)
    out_dir = Path(layout.eval_outputs("finetune", method))
    source = Path(checkpoint) if checkpoint else Path(layout.checkpoints("pretrain", method))
    spec = finetune_spec(plan, run_dir, task)
    t0 = time.monotonic()
    before, _, _ = load_pretrained(plan, run_dir, source, spec, plan.finetune.seeds[0])
    pretrained = _score(plan, run_dir, before, task, out_dir / "pretrained")
    finetuned = []
    first_model = None
    for i, seed in enumerate(plan.finetune.seeds):
        ckpt = layout.checkpoints("finetune", method, None if i == 0 else seed)
        if not Path(ckpt).exists():
            continue  # a stopped run fine-tuned fewer seeds
        model = spec.init(seed)
        meta = load_into_model(ckpt, model)
        finetuned.append(
            {"seed": seed, "steps": meta.get("steps"), **_score(plan, run_dir, model, task, out_dir / f"seed{seed}")}
        )
        first_model = first_model or model
    result: dict[str, Any] = {
        "method": method,
        "stage": "finetune",
        "source_checkpoint": str(source),
        "task": {
            **{
                k: task[k]
                for k in ("name", "modality", "primary", "description", "train_items", "test_items", "baselines")
                if k in task
            },
            "metrics": _task_metrics_meta(task),
            **({"max_gen_toks": max_gen_tokens(plan.finetune, task)} if task["modality"] == "text" else {}),
        },
        "pretrained": pretrained,
        "finetuned": finetuned,
    }
    if task["modality"] == "text" and first_model is not None and plan.eval.enabled:
        from data.store import load_heldout, load_tokenizer
        from evals.run_eval import evaluate_lm

        after = evaluate_lm(
            first_model,
            load_tokenizer(run_dir),
            load_heldout(run_dir, "test"),
            out_dir / "pretrain_tasks",
            plan.eval,
            seed=plan.seed,
            name="lm_eval",
        )
        before_path = Path(layout.eval_result("pretrain", method))
        before_flat = json.loads(before_path.read_text()) if before_path.is_file() and not checkpoint else None
        keys = [k for k, v in after.items() if isinstance(v, float) and k.startswith("heldout_")]
        result["pretrain_tasks"] = {
            "pretrained": {k: before_flat.get(k) for k in keys} if before_flat else None,
            "finetuned": {k: after[k] for k in keys},
        }
    result["eval_s"] = time.monotonic() - t0
    atomic.write_text(layout.eval_result("finetune", method), json.dumps(result, indent=2))
    return result
