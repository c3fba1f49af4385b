"""What a post-training step's loss counts (issue 25, part 2): every target token of the batch once
whatever the microbatching, the stop token that closes a response, no step on a batch without a
target, and LoRA with its α/r scale and an adapter-only checkpoint that refuses another rank or α."""

import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs.model import DenseLMConfig
from data import finetune as F
from tests.conftest import jsonl_finetune_run

V, L = 64, 16


def _lm_spec():
    from models import InputShape, build_model

    return build_model(DenseLMConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32), InputShape(vocab_size=V, seq_len=L))


def _ragged_batch(rows: int = 8) -> dict:
    """Rows with very different numbers of target tokens: row i has 1 + 2·i targets (1 … 15)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, size=(rows, L + 1)).astype(np.int32)
    mask = np.zeros((rows, L + 1), np.float32)
    for i in range(rows):
        mask[i, L + 1 - (1 + 2 * i) :] = 1.0
    return {"ids": jnp.asarray(ids), "mask": jnp.asarray(mask)}


@pytest.mark.slow
def test_four_microbatches_give_the_whole_batch_update_on_a_masked_batch():
    """One SGD step on a batch whose rows hold 1 … 15 target tokens: the parameters after the step
    are the same (within 1e-6) with 1 and with 4 microbatches, and so is the reported loss: the
    mean over the batch's 64 target tokens, not the mean of the microbatches' means."""
    from training.step import Trainer

    spec, batch = _lm_spec(), _ragged_batch()
    out = {}
    for G in (1, 4):
        trainer = Trainer(spec, optax.sgd(1.0), microbatches=G, seed=0)
        params = trainer.init_params()
        params, _, metrics = trainer.step(params, trainer.init_opt(params), batch)
        out[G] = ({k: np.asarray(v) for k, v in params.items()}, float(metrics["loss"]))
    worst = max(float(np.abs(out[1][0][k] - out[4][0][k]).max()) for k in out[1][0])
    assert worst <= 1e-6, f"1 vs 4 microbatches: parameters differ by up to {worst:.2e}"
    assert out[4][1] == pytest.approx(out[1][1], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["packed text", "images"])
def test_unpadded_batches_count_every_row_alike(family):
    """Pretraining's packed text rows and the vision families' labelled images: every row holds the
    same number of targets (L tokens, 1 image), so 4 microbatches give the one-pass update too."""
    from configs.model import ViTConfig
    from models import InputShape, build_model
    from training.step import Trainer

    rng = np.random.default_rng(1)
    if family == "images":
        spec = build_model(
            ViTConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, patch_size=4),
            InputShape(image_shape=(8, 8, 1), num_classes=4, pixel_max=16),
        )
        batch = {
            "image": jnp.asarray(rng.integers(0, 17, (8, 8, 8, 1), dtype=np.uint8)),
            "label": jnp.asarray(np.arange(8) % 4, dtype=jnp.int32),
        }
        assert float(spec.count_targets(batch)) == 8
    else:
        spec = _lm_spec()
        batch = jnp.asarray(rng.integers(0, V, (8, L + 1)), jnp.int32)
        assert float(spec.count_targets(batch)) == 8 * L
    out = {}
    for G in (1, 4):
        trainer = Trainer(spec, optax.sgd(1.0), microbatches=G, seed=0)
        params = trainer.init_params()
        out[G] = {k: np.asarray(v) for k, v in trainer.step(params, trainer.init_opt(params), batch)[0].items()}
    assert max(float(np.abs(out[1][k] - out[4][k]).max()) for k in out[1]) <= 1e-6


def test_held_out_loss_weighs_every_target_token_once():
    """The held-out loss over several batches is the mean over all their target tokens."""
    from training.evaluation import heldout_metrics
    from training.step import Trainer

    trainer = Trainer(_lm_spec(), optax.sgd(0.0))
    params = trainer.init_params()
    batch = _ragged_batch()
    halves = [{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}]
    whole = float(trainer.evaluate(params, batch)["loss"])
    assert heldout_metrics(trainer.evaluate, params, halves)["loss"] == pytest.approx(whole, abs=1e-6)


def test_the_stop_token_closing_a_response_is_a_training_target():
    """Padded rows: the EOT right after the response has mask 1 (the model learns to stop), the
    padding after it mask 0; packed rows: each pair's closing EOT is a target too."""
    eot = 0
    ids, mask, info = F.pack_rows([([5, 6, 7], [8, 9])], 8, eot_id=eot)
    assert ids[0].tolist() == [5, 6, 7, 8, 9, eot, eot, eot]
    assert mask[0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0]
    assert info["response_tokens"] == 2 and info["target_tokens"] == 3
    ids, mask, _ = F.pack_rows([([5], [8]), ([6], [9])], 6, eot_id=eot, packing=True)
    assert ids[0].tolist() == [5, 8, eot, 6, 9, eot] and mask[0].tolist() == [0, 1, 1, 0, 1, 1]
    # a response that fills the row: the stop token cannot fit and the response counts as truncated
    ids, mask, info = F.pack_rows([([5], [8, 9, 10])], 4, eot_id=eot)
    assert ids[0].tolist() == [5, 8, 9, 10] and mask[0].tolist() == [0, 1, 1, 1]
    assert info["truncated_responses"] == 1


def test_the_fine_tuning_loss_counts_the_stop_token():
    from models.text.dense import DecoderLM, lm_objective

    model = DecoderLM(DenseLMConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32), V, 8, nnx.Rngs(0))
    ids, mask, _ = F.pack_rows([([5, 6, 7], [8, 9])], 8, eot_id=0)
    loss, _ = lm_objective(model, {"ids": jnp.asarray(ids), "mask": jnp.asarray(mask)})
    nll = optax.softmax_cross_entropy_with_integer_labels(model(jnp.asarray(ids[:, :-1])), jnp.asarray(ids[:, 1:]))[0]
    assert float(loss) == pytest.approx(float(nll[2:5].mean()), rel=1e-5)  # targets 8, 9 and the EOT


# ------------------------------------------------------------------------------ fine-tuning runs


def _blank_rows(layout, rows: slice | None) -> None:
    """Zero the target mask of the given train rows (None: every row)."""
    path = layout.finetune_data / "train.npz"
    with np.load(path) as z:
        data = {k: z[k] for k in z.files}
    data["mask"][rows if rows is not None else slice(None)] = 0.0
    np.savez(path, **data)


@pytest.mark.slow
def test_a_batch_without_a_target_token_is_skipped_and_counted(small_cfg, small_data, tmp_path, monkeypatch):
    """Rows whose mask holds no target: a batch made only of them takes no optimizer step (the
    parameters stay bit-identical) and is counted in the record, never trained at loss 0."""
    import training.finetune as T

    cfg, run_dir, layout, task = jsonl_finetune_run(small_cfg, small_data, tmp_path, steps=2, eval_every_steps=2)
    _blank_rows(layout, slice(None))
    data = T.load_finetune_rows(layout.finetune_data, "train")
    assert data["mask"].sum() == 0
    # every batch empty: refused, naming what to fix
    with pytest.raises(ValueError, match="no target token"):
        T.finetune_run(
            T.FinetunePlan.of(cfg), run_dir, layout.checkpoints("pretrain", "dp"), layout.finetune_data, task, seed=0
        )
    # one batch of two empty: skipped and counted, the other trained
    with np.load(layout.finetune_data / "test.npz") as z:
        good = z["mask"][:1].copy()
    order = T.batch_order(len(data["mask"]), cfg.finetune.batch_size, cfg.finetune.steps, 0)
    data["mask"][order[1]] = np.resize(good, (len(order[1]), good.shape[1]))  # the second batch has targets
    np.savez(layout.finetune_data / "train.npz", **data)
    seen = []
    real = T.make_train_step

    def spy(*a, **k):
        step = real(*a, **k)
        return lambda params, opt, batch, frozen=None: (
            seen.append(float(np.asarray(batch["mask"]).sum())),
            step(params, opt, batch, frozen),
        )[1]

    monkeypatch.setattr(T, "make_train_step", spy)
    rec = T.finetune_run(
        T.FinetunePlan.of(cfg), run_dir, layout.checkpoints("pretrain", "dp"), layout.finetune_data, task, seed=0
    )
    assert rec["steps"] == 2 and rec["skipped_empty_batches"] == 1
    assert len(seen) == 1 and seen[0] > 0  # only the batch with targets reached the step


def test_lora_alpha_scales_the_forward_pass_and_the_merge():
    from models.layers.lora import add_lora, merge_lora
    from models.text.dense import DecoderLM
    from training.functional import Functional, load_params

    cfg = DenseLMConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32)
    ids = jnp.arange(8)[None] % V
    outs = {}
    for alpha in (None, 4.0, 8.0):  # rank 4: scales 1, 1 and 2
        model = DecoderLM(cfg, V, 8, nnx.Rngs(0))
        add_lora(model, 4, ["qkv", "down"], nnx.Rngs(1), alpha=alpha)
        _, flat = Functional.of(model)
        flat = {k: (jnp.full_like(v, 0.05) if k.endswith("lora_b") else v) for k, v in flat.items()}
        adapted = Functional.of(model)[0].module(flat)(ids)
        plain = DecoderLM(cfg, V, 8, nnx.Rngs(0))
        load_params(plain, merge_lora(flat, scale=(alpha or 4) / 4))
        assert jnp.allclose(plain(ids), adapted, atol=1e-5), alpha  # the merge folds in the same scale
        outs[alpha] = adapted
    assert jnp.allclose(outs[None], outs[4.0])  # the default α = r: today's model
    assert not jnp.allclose(outs[8.0], outs[4.0], atol=1e-4)
    # one layer: y = x W + (α/r) x A B, in the layer's call and in project()
    from models.layers.lora import ScaledLoRA, project

    layer = ScaledLoRA(6, 2, 5, alpha=6.0, base_module=nnx.Linear(6, 5, rngs=nnx.Rngs(2)), rngs=nnx.Rngs(3))
    layer.lora_b[...] = jnp.ones((2, 5))
    x = jnp.arange(12.0).reshape(2, 6) / 10
    want = (
        x @ layer.base_module.kernel[...]
        + layer.base_module.bias[...]
        + 3.0 * x @ layer.lora_a[...] @ layer.lora_b[...]
    )
    assert jnp.allclose(layer(x), want, atol=1e-5) and jnp.allclose(project(layer, x), want, atol=1e-5)


def test_lora_alpha_is_a_finetune_field_defaulting_to_the_rank():
    from configs.finetune import FinetuneConfig

    assert FinetuneConfig().lora_alpha is None
    assert FinetuneConfig(lora_rank=4, lora_alpha=16).lora_alpha == 16
    with pytest.raises(ValueError, match="lora_alpha"):
        FinetuneConfig(lora_alpha=0)


@pytest.mark.slow
def test_a_lora_run_writes_an_adapter_checkpoint_that_refuses_another_rank_or_alpha(small_cfg, small_data, tmp_path):
    """Beside the merged checkpoint: the adapters alone, with rank, α and targets recorded; they load
    back into a model adapted the same way (the same outputs as the merged model) and are refused,
    naming both values, by a model with another rank or α."""
    from models.layers.lora import add_lora
    from training.checkpoint import CheckpointError, load_meta
    from training.finetune import (
        FinetunePlan,
        finetune_method,
        finetune_spec,
        load_adapters,
        load_pretrained,
        model_with,
    )
    from training.functional import Functional

    cfg, run_dir, layout, task = jsonl_finetune_run(
        small_cfg, small_data, tmp_path, mode="lora", lora_rank=2, lora_alpha=8, lora_targets=["qkv", "down"]
    )
    finetune_method(cfg, run_dir, "dp", task)
    adapters = layout.adapters("finetune", "dp")
    assert adapters.is_dir() and layout.checkpoints("finetune", "dp").is_dir()
    meta = load_meta(adapters)
    assert (meta["lora_rank"], meta["lora_alpha"], meta["lora_targets"]) == (2, 8.0, ["qkv", "down"])
    assert meta["adapted"] == [f"blocks/{i}/{p}" for i in range(cfg.model.n_layers) for p in ("attn/qkv", "mlp/down")]
    summary = json.loads(layout.summary("finetune", "dp").read_text())
    assert summary["runs"][0]["adapters"] == "finetune/dp/adapters"
    assert summary["recipe"]["lora_alpha"] == 8.0

    spec = finetune_spec(FinetunePlan.of(cfg), run_dir, task)
    ids = jnp.asarray(F.load_finetune_rows(layout.finetune_data, "test")["ids"][:2, :-1])
    model, _, _ = load_pretrained(FinetunePlan.of(cfg), run_dir, layout.checkpoints("pretrain", "dp"), spec, 0)
    add_lora(model, 2, ["qkv", "down"], nnx.Rngs(5), alpha=8)
    load_adapters(adapters, model)
    merged = model_with(spec, {})
    from training.checkpoint import load_into_model

    load_into_model(layout.checkpoints("finetune", "dp"), merged)
    assert jnp.allclose(model(ids), merged(ids), atol=1e-5)
    assert any(np.abs(np.asarray(v)).max() > 0 for k, v in Functional.of(model)[1].items() if k.endswith("lora_b"))

    for rank, alpha, words in ((4, 8, ["rank 4", "rank 2"]), (2, 2, ["α 2.0", "α 8.0"])):
        other, _, _ = load_pretrained(FinetunePlan.of(cfg), run_dir, layout.checkpoints("pretrain", "dp"), spec, 0)
        add_lora(other, rank, ["qkv", "down"], nnx.Rngs(5), alpha=alpha)
        with pytest.raises(CheckpointError) as err:
            load_adapters(adapters, other)
        for w in words:
            assert w in str(err.value), (w, str(err.value))
