"""The precision policy (config ``precision``, ``training.precision``): bfloat16 compute really runs
in bfloat16 (the compiled step's matmuls) with a float32 loss; parameters and optimizer state stay
in their own dtypes; a bfloat16 learner's fragments, the outer gradients, the syncer's global
fragments and outer momentum stay float32; DP's final checkpoint is float32."""

import re
import shutil
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco.syncer as syncer_module
from configs.model import DenseLMConfig, MoELMConfig, ViTConfig
from configs.runtime import PrecisionConfig
from configs.schema import ExperimentConfig
from diloco.fragments import balanced_fragments
from diloco.learner import run_learner
from diloco.pacing import FairTurns
from diloco.syncer import Syncer, SyncerSettings
from diloco.tensors import tensor_bytes, to_numpy
from models import InputShape, build_model
from models.layers.ops import causal_attention, softmax_cross_entropy_head
from training.precision import cast_floating, dtypes, with_state_dtype
from training.step import Trainer, _loss_and_grad

LM = DenseLMConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, tie_embeddings=False)
SHAPE = InputShape(vocab_size=50, seq_len=8)
BF16 = PrecisionConfig(params="bfloat16", compute="bfloat16", opt_state="bfloat16")
MIXED = PrecisionConfig(compute="bfloat16")


def _floating(tree) -> set[str]:
    return {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def _dot_operand_dtypes(trainer: Trainer, batch) -> Counter:
    """(lhs, rhs) element types of every dot in the lowered forward + backward pass."""
    fn = _loss_and_grad(trainer.fn, trainer.spec.objective, None if trainer.dtypes is None else trainer.dtypes.compute)
    text = jax.jit(fn).lower(trainer.init_params(), {}, batch).as_text()
    pairs = re.findall(r"stablehlo.dot_general[^\n]*: \(tensor<([^>]*)>, tensor<([^>]*)>\)", text)
    return Counter((a.rsplit("x", 1)[-1], b.rsplit("x", 1)[-1]) for a, b in pairs)


def test_config_policy_and_refusal():
    cfg = ExperimentConfig.model_validate({"precision": {"compute": "bfloat16"}})
    assert cfg.precision.describe() == "params float32 · compute bfloat16 · optimizer state float32"
    assert cfg.precision == MIXED and dtypes(ExperimentConfig().precision) is None
    assert dtypes(MIXED) == (jnp.float32, jnp.bfloat16, jnp.float32)
    with pytest.raises(Exception, match="precision.compute"):
        ExperimentConfig.model_validate({"precision": {"compute": "float16"}})
    with pytest.raises(Exception, match="precision.param_dtype"):
        ExperimentConfig.model_validate({"precision": {"param_dtype": "bfloat16"}})


@pytest.mark.slow
@pytest.mark.parametrize("policy", [MIXED, BF16], ids=["mixed", "bf16"])
def test_bfloat16_compute_runs_in_bfloat16_with_a_float32_loss(policy):
    spec = build_model(LM, SHAPE)
    batch = np.random.default_rng(0).integers(0, 50, (4, 9)).astype(np.int32)
    float32, mixed = (
        Trainer(spec, optax.adamw(1e-2), microbatches=2),
        Trainer(spec, optax.adamw(1e-2), 2, precision=policy),
    )
    dots = _dot_operand_dtypes(mixed, batch)
    assert dots[("bf16", "bf16")] >= 20 and set(dots) == {("bf16", "bf16")}, dots  # every matmul in bfloat16
    assert set(_dot_operand_dtypes(float32, batch)) == {("f32", "f32")}
    runs = {}
    for name, t in (("f32", float32), ("policy", mixed)):
        p = t.init_params()
        o = t.init_opt(p)
        losses = []
        for _ in range(6):
            p, o, m = t.step(p, o, batch)
            losses.append(float(m["loss"]))
        assert m["loss"].dtype == jnp.float32
        runs[name] = (losses, p, o)
    losses, p, o = runs["policy"]
    assert _floating(p) == {policy.params} and _floating(o) == {policy.opt_state}
    assert {str(x.dtype) for x in jax.tree.leaves(o) if not jnp.issubdtype(x.dtype, jnp.floating)} == {"int32"}
    assert losses[-1] < losses[0] - 0.05  # it trains
    np.testing.assert_allclose(losses, runs["f32"][0], atol=0.05)  # and follows float32's curve


def test_state_dtype_wrapper_and_ops_in_bfloat16():
    params = {"w": jnp.ones((3,), jnp.float32)}
    tx = with_state_dtype(optax.adamw(0.1), jnp.bfloat16)
    state = tx.init(params)
    assert _floating(state) == {"bfloat16"}
    updates, state = tx.update({"w": jnp.full((3,), 0.5, jnp.float32)}, state, params)
    assert _floating(state) == {"bfloat16"} and updates["w"].dtype == jnp.float32
    assert cast_floating({"i": jnp.arange(3), "x": jnp.ones(2)}, jnp.bfloat16)["i"].dtype == jnp.int32
    # attention and the fused head: float32 softmax and loss, gradients in the inputs' dtype
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2, 8, 4)), jnp.float32) for _ in range(3))
    ref = causal_attention(q, k, v)
    low = causal_attention(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(low, np.float32), ref, atol=0.05)
    g = jax.grad(lambda q, k, v: causal_attention(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))(
        *(a.astype(jnp.bfloat16) for a in (q, k, v))
    )
    assert {x.dtype for x in g} == {jnp.dtype(jnp.bfloat16)}
    x, w = (
        jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
        jnp.asarray(rng.standard_normal((8, 30)), jnp.float32),
    )
    labels = jnp.asarray(rng.integers(0, 30, 16))
    loss = softmax_cross_entropy_head(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), labels)
    assert loss.dtype == jnp.float32
    assert float(loss) == pytest.approx(float(softmax_cross_entropy_head(x, w, labels)), abs=0.05)
    gx, gw = jax.grad(softmax_cross_entropy_head, argnums=(0, 1))(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), labels
    )
    assert gx.dtype == gw.dtype == jnp.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, shape",
    [
        (MoELMConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, n_experts=4, top_k=2, moe_every=2), SHAPE),
        (
            ViTConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, patch_size=4),
            InputShape(image_shape=(8, 8, 1), num_classes=10, pixel_max=16),
        ),
    ],
    ids=["moe_lm", "vit"],
)
def test_every_family_computes_in_bfloat16(model, shape):
    spec = build_model(model, shape)
    rng = np.random.default_rng(0)
    if shape.vocab_size:
        batch = rng.integers(0, 50, (4, 9)).astype(np.int32)
    else:
        batch = {"image": rng.integers(0, 16, (4, 8, 8, 1)).astype(np.uint8), "label": rng.integers(0, 10, 4)}
    t = Trainer(spec, optax.adamw(1e-2), precision=MIXED)
    dots = _dot_operand_dtypes(t, batch)
    # bfloat16 but for the MoE router (float32 by design: Switch Transformer's selective precision)
    assert dots[("bf16", "bf16")] > 2 * sum(n for d, n in dots.items() if d != ("bf16", "bf16")), dots
    p = t.init_params()
    o = t.init_opt(p)
    p, o, m = t.step(p, o, batch)
    assert np.isfinite(float(m["loss"])) and m["loss"].dtype == jnp.float32 and _floating(p) == {"float32"}


class _MergingExchange:
    """Merges each submission at once with a real Syncer (quorum 1) and publishes the result."""

    def __new__(cls, syncer, budget):
        from diloco.exchange import InMemoryExchange

        class Ex(InMemoryExchange):
            def submit(self, sub):
                self.subs.append(sub)
                syncer.receive(sub, 0.0)
                for rec in syncer.poll(0.0, live={sub.learner}):
                    p = rec["fragment"]
                    self.publish(p, syncer.versions[p], syncer.global_params[p])

        ex = Ex(syncer.num_fragments, budget)
        ex.subs = []
        for p in range(syncer.num_fragments):
            ex.publish(p, 0, syncer.global_params[p])
        return ex


def test_bfloat16_learner_keeps_the_syncer_state_and_outer_gradients_float32(monkeypatch):
    """A learner with every dtype bfloat16 against a real syncer with Nesterov momentum: its
    parameters stay bfloat16 through every pull; what it sends, the outer gradients, Θ_p and the
    outer momentum are float32 at every merge."""
    from diloco.learner import LearnerSetup
    from diloco.receipt import receipt_rule

    spec = build_model(LM, SHAPE)
    trainer = Trainer(spec, optax.adamw(1e-2), precision=BF16)
    theta0 = to_numpy(trainer.init_params())
    fragments = balanced_fragments(tensor_bytes(theta0), 2)
    syncer = Syncer(
        theta0,
        fragments,
        SyncerSettings(
            num_learners=1, quorum=1, merge="token_weighted", outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True
        ),
    )
    seen = []
    real_step = syncer_module.outer_step

    def recording_step(tx, params, state, outer_grad):
        seen.append((_floating(outer_grad), _floating(params), _floating(state)))
        return real_step(tx, params, state, outer_grad)

    monkeypatch.setattr(syncer_module, "outer_step", recording_step)
    steps, B, L = 12, 2, 8
    exchange = _MergingExchange(syncer, budget=steps * B * L)
    learner_dtypes = []

    def step(params, opt_state, batch):
        learner_dtypes.append(_floating(params) | _floating(opt_state))
        return trainer.step(params, opt_state, batch)

    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 50, (B, L + 1)).astype(np.int32) for _ in range(steps)]
    out = run_learner(
        LearnerSetup(
            learner=0,
            attempt=1,
            step=step,
            init_params=trainer.init_params,
            init_opt=trainer.init_opt,
            next_batch=lambda e, i: (batches[i % steps], e, i + 1),
            fragments=fragments,
            period=2,
            tokens_per_step=B * L,
            receipt=receipt_rule("overwrite"),
            exchange=exchange,
            log=lambda rec: None,
            turns=FairTurns(1),
        )
    )
    assert out["steps"] == steps and syncer.num_merges >= steps // 2 and len(seen) == syncer.num_merges
    assert learner_dtypes and all(d == {"bfloat16"} for d in learner_dtypes)  # bfloat16 after every pull
    assert all(_floating(s.params) == {"float32"} for s in exchange.subs)  # sent as float32
    assert all(s == ({"float32"}, {"float32"}, {"float32"}) for s in seen)  # outer grad, Θ_p, momentum
    assert all(_floating(g) == {"float32"} for g in syncer.global_params)
    assert all(_floating(s) == {"float32"} for s in syncer.opt_states)
    assert any(
        np.abs(np.concatenate([np.ravel(x) for x in jax.tree.leaves(s)])).max() > 0 for s in syncer.opt_states
    )  # the momentum is really there


@pytest.mark.slow
def test_dp_in_bfloat16_saves_a_float32_checkpoint(small_cfg, small_data, tmp_path):
    from run.layout import RunLayout
    from training.checkpoint import latest_step
    from training.dp import train_dp

    run_dir = tmp_path / "run"
    shutil.copytree(small_data / "data", run_dir / "data")
    cfg = ExperimentConfig.model_validate(
        {
            **small_cfg.model_dump(),
            "precision": PrecisionConfig(params="bfloat16", compute="bfloat16").model_dump(),
            "train": {**small_cfg.train.model_dump(), "token_budget": 8192, "eval_every_tokens": 8192},
        }
    )
    summary = train_dp(cfg, run_dir)
    assert summary["hyperparameters"]["precision"] == "params bfloat16 · compute bfloat16 · optimizer state float32"
    assert summary["hyperparameters"]["backend"].startswith("cpu: ")
    assert np.isfinite(summary["final_val_loss"])
    import orbax.checkpoint as ocp

    ckpt = RunLayout(run_dir).checkpoints("pretrain", "dp")
    on_disk = ocp.StandardCheckpointer().metadata(ckpt / str(latest_step(ckpt)) / "params").item_metadata
    assert {str(x.dtype) for x in jax.tree.leaves(on_disk)} == {"float32"}  # float32 on disk
