"""The mixture-of-experts layer and the MoE LM: equal to the dense MLP with one expert, capacity
drops exactly the choices beyond it, the auxiliary losses equal their formulas, the LM routes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs.load import validation_lines
from configs.model import MoELMConfig
from configs.schema import ExperimentConfig
from models import InputShape, build_model
from models.layers.mlp import SwiGLU
from models.layers.moe import MoE, collect_stats, expert_capacity, moe_blocks, route
from models.text.moe import flops_per_token
from training.step import Trainer


@pytest.mark.slow
def test_one_expert_top1_dropless_is_the_dense_mlp():
    d, f = 16, 24
    moe = MoE(d, f, 2, num_experts=1, top_k=1, capacity_factor=None, rngs=nnx.Rngs(0))
    mlp = SwiGLU(d, f, 2, nnx.Rngs(1))
    mlp.gate.kernel[...] = moe.gate[...][0]
    mlp.up.kernel[...] = moe.up[...][0]
    mlp.down.kernel[...] = moe.down[...][0]
    x = jax.random.normal(jax.random.key(2), (3, 7, d))
    y, inter = nnx.capture(moe, nnx.Intermediate)(x)
    np.testing.assert_allclose(y, mlp(x), rtol=1e-5, atol=1e-6)
    (stats,) = collect_stats(inter)
    assert float(stats["dropped"]) == 0.0 and float(stats["aux"]) == pytest.approx(1.0)


def test_capacity_drops_exactly_the_choices_beyond_it():
    """One group of 6 tokens, 2 experts, k = 1, 2 slots each: tokens 0, 1, 2, 4 pick expert 0 and
    3, 5 pick expert 1; expert 0 keeps its first two (0, 1) and drops 2 and 4."""
    picks = [0, 0, 0, 1, 0, 1]
    logits = jnp.asarray([[[3.0, 0.0] if e == 0 else [0.0, 3.0] for e in picks]])
    dispatch, combine, stats = route(logits, top_k=1, capacity=2)
    assert dispatch.shape == (1, 6, 2, 2)
    slots = {(s, e, c) for s, e, c in zip(*np.nonzero(np.asarray(dispatch[0])), strict=True)}
    assert slots == {(0, 0, 0), (1, 0, 1), (3, 1, 0), (5, 1, 1)}
    assert float(stats["dropped"]) == pytest.approx(2 / 6)
    np.testing.assert_allclose(stats["load"], [4 / 6, 2 / 6])  # before capacity
    p = float(jax.nn.softmax(jnp.asarray([3.0, 0.0]))[0])
    np.testing.assert_allclose(np.asarray(combine).sum(axis=(2, 3))[0], [p, p, 0, p, 0, p], rtol=1e-6)
    assert expert_capacity(6, 2, 1, None) == 6 and expert_capacity(6, 2, 1, 0.5) == 2
    assert expert_capacity(128, 8, 2, 1.25) == 40


def test_second_choices_queue_behind_every_first_choice():
    """k = 2, 3 experts, capacity 2: every token's first choice is expert 0 or 1 and its second is
    expert 2 or 0. Expert 0's slots go to the first choices (tokens 0, 2) before token 1's second
    choice, which is dropped; the gates of each token's kept choices are renormalised over k."""
    logits = jnp.log(jnp.asarray([[[0.6, 0.1, 0.3], [0.3, 0.6, 0.1], [0.7, 0.1, 0.2]]]))
    dispatch, combine, stats = route(logits, top_k=2, capacity=2)
    d = np.asarray(dispatch[0])
    assert d[0, 0].sum() == 1 and d[2, 0].sum() == 1 and d[1, 0].sum() == 0  # token 1's 2nd choice dropped
    assert d[1, 1].sum() == 1 and d[0, 2].sum() == 1 and d[2, 2].sum() == 1
    assert float(stats["dropped"]) == pytest.approx(1 / 6)
    c = np.asarray(combine[0]).sum(axis=-1)
    np.testing.assert_allclose(c[0], [0.6 / 0.9, 0, 0.3 / 0.9], rtol=1e-5)
    np.testing.assert_allclose(c[1], [0, 0.6 / 0.9, 0], rtol=1e-5)


def test_aux_and_z_losses_equal_their_formulas():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 4)).astype(np.float32)
    _, _, stats = route(jnp.asarray(logits), top_k=1, capacity=5)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    f = np.bincount(logits.argmax(-1).ravel(), minlength=4) / 10  # Switch: fraction routed to e
    P = probs.reshape(-1, 4).mean(0)
    assert float(stats["aux"]) == pytest.approx(4 * np.sum(f * P), rel=1e-5)
    lse = np.log(np.exp(logits).sum(-1))
    assert float(stats["z"]) == pytest.approx(np.mean(lse**2), rel=1e-5)


TINY_MOE = MoELMConfig(
    d_model=32, n_layers=2, n_heads=2, d_ff=64, n_experts=4, top_k=2, moe_every=2, tie_embeddings=False
)


def test_moe_lm_spec_counts_active_parameters_and_reports_the_cross_entropy():
    spec = build_model(TINY_MOE, InputShape(vocab_size=64, seq_len=16))
    assert moe_blocks(TINY_MOE) == [1] and spec.extras["moe_layers"] == [1]
    # the idle experts: 2 of 4 in one layer, 3 matrices of 32 × 64 each
    assert spec.extras["total_params"] - spec.extras["active_params"] == 2 * 3 * 32 * 64
    dense_mlp = 3 * 32 * 64
    moe_active = 32 * 4 + 2 * 3 * 32 * 64
    assert (
        flops_per_token(TINY_MOE, 64, 16)
        == 6.0 * (2 * 4 * 32 * 32 + dense_mlp + moe_active + 32 * 64) + 12.0 * 2 * 32 * 16
    )
    trainer = Trainer(spec, optax.adam(3e-3))
    params = trainer.init_params()
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 17), dtype=np.int32))
    out = trainer.evaluate(params, batch)
    assert float(out["loss"]) == float(out["ce"]) < float(out["objective"])
    expected = float(out["ce"]) + 0.01 * float(out["moe/aux"]) + 0.001 * float(out["moe/z"])
    assert float(out["objective"]) == pytest.approx(expected, rel=1e-6)
    loads = [float(out[f"moe/1/load/{e}"]) for e in range(4)]
    assert sum(loads) == pytest.approx(1.0, rel=1e-6)


def test_moe_config_is_checked_by_kind():
    def refusal(model: dict) -> str:
        with pytest.raises(Exception) as err:
            ExperimentConfig.model_validate({"model": model})
        return " | ".join(validation_lines(err.value))

    assert "model.kind: 'mlp' is unknown; choose one of dense_lm, moe_lm" in refusal({"kind": "mlp"})
    assert refusal({"kind": "moe_lm", "n_experts": 2, "top_k": 2, "n_layers": 1, "moe_every": 2}).startswith(
        "model.moe_every (2) exceeds model.n_layers (1)"
    )
    assert "a field of kind: moe_lm" in refusal({"kind": "dense_lm", "n_experts": 4})
    assert "model.top_k" in refusal({"kind": "moe_lm", "top_k": 3})
    assert "model.capacity_factor (0.01) × model.top_k (2) = 0.02 < 1" in refusal(
        {"kind": "moe_lm", "capacity_factor": 0.01}
    )
    assert "use ≥ 1 (1.25 is usual)" in refusal({"kind": "moe_lm", "top_k": 1, "capacity_factor": 0.5})
    assert ExperimentConfig.model_validate({"model": {"d_model": 64}}).model.kind == "dense_lm"


# -- padding (fine-tuning batches): only real tokens are routed, counted and take capacity ------------

# Drops on purpose (C = ⌈0.5 · 2 · n / 4⌉ slots for n real tokens) and two MoE layers of four blocks.
PAD_MOE = MoELMConfig(
    d_model=32,
    n_layers=4,
    n_heads=2,
    d_ff=64,
    n_experts=4,
    top_k=2,
    moe_every=2,
    capacity_factor=0.5,
    tie_embeddings=False,
)
# (prompt length, response length) of each row: prompt + response tokens are the row's real tokens
PAD_ROWS = [(4, 3), (6, 4), (2, 3)]


def _sft_batch(row_len: int, eot: int = 0) -> dict:
    """A fine-tuning batch ``{"ids", "mask"}`` of :data:`PAD_ROWS`, right-padded with ``eot`` to ``row_len``."""
    rng = np.random.default_rng(7)
    ids = np.full((len(PAD_ROWS), row_len), eot, np.int32)
    mask = np.zeros((len(PAD_ROWS), row_len), np.float32)
    for r, (p, n) in enumerate(PAD_ROWS):
        ids[r, : p + n] = rng.integers(1, 64, p + n)
        mask[r, p : p + n] = 1.0
    return {"ids": jnp.asarray(ids), "mask": jnp.asarray(mask)}


@pytest.mark.slow
def test_padding_changes_neither_the_loss_nor_the_router_figures():
    """The same rows padded to 11 and to 24 tokens: cross entropy, aux and z losses, dropped fraction
    and the experts' loads are the same (padding is neither routed nor counted)."""
    spec = build_model(PAD_MOE, InputShape(vocab_size=64, seq_len=23))
    model = spec.init(0)
    short, _ = spec.objective(model, _sft_batch(11))
    out = {}
    for row_len in (11, 24):
        loss, metrics = spec.objective(model, _sft_batch(row_len))
        out[row_len] = {"objective": float(loss), **{k: float(v) for k, v in metrics.items()}}
    assert out[11]["moe/dropped"] > 0  # capacity binds on the real tokens
    for key, value in out[11].items():
        assert out[24][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_real_tokens_see_the_same_model_with_or_without_padding():
    """Each padded row's real positions give the logits of that row alone, unpadded (same capacity:
    it is counted from the row's real tokens)."""
    from models.text.dense import input_mask, lm_inputs

    spec = build_model(PAD_MOE, InputShape(vocab_size=64, seq_len=23))
    model = spec.init(0)
    batch = _sft_batch(24)
    mask_BL = input_mask(batch)
    np.testing.assert_array_equal(np.asarray(mask_BL).sum(1), [p + n - 1 for p, n in PAD_ROWS])
    padded = np.asarray(model(lm_inputs(batch), mask_BL))
    for r, (p, n) in enumerate(PAD_ROWS):
        alone = np.asarray(model(batch["ids"][r : r + 1, : p + n - 1]))[0]
        np.testing.assert_allclose(padded[r, : p + n - 1], alone, rtol=1e-5, atol=1e-5)


def test_padding_takes_no_expert_slot():
    """Six tokens, two experts, k = 1, two slots: the two (left) padding tokens pick expert 0 like
    real tokens 2 and 3; they take no slot, so 2 and 3 keep theirs and nothing real is dropped."""
    picks = [0, 0, 0, 0, 1, 1]
    logits = jnp.asarray([[[3.0, 0.0] if e == 0 else [0.0, 3.0] for e in picks]])
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1]], jnp.float32)
    dispatch, combine, stats = route(logits, top_k=1, capacity=2, mask_GS=mask)
    slots = {(s, e, c) for s, e, c in zip(*np.nonzero(np.asarray(dispatch[0])), strict=True)}
    assert slots == {(2, 0, 0), (3, 0, 1), (4, 1, 0), (5, 1, 1)}
    assert float(np.asarray(combine)[0, :2].sum()) == 0.0
    assert float(stats["dropped"]) == 0.0
    np.testing.assert_allclose(stats["load"], [0.5, 0.5])
    p = float(jax.nn.softmax(jnp.asarray([3.0, 0.0]))[0])
    np.testing.assert_allclose(stats["prob"], [0.5, 0.5], rtol=1e-6)
    assert float(stats["aux"]) == pytest.approx(2 * (0.5 * 0.5 + 0.5 * 0.5))
    assert float(stats["z"]) == pytest.approx(float(jnp.log(jnp.exp(3.0) + 1.0)) ** 2, rel=1e-6)
    assert p > 0.9


@pytest.mark.slow
def test_auxiliary_losses_are_averaged_over_the_moe_layers():
    """aux_loss_weight and z_loss_weight weigh the mean over MoE layers (the same at any depth)."""
    from models.layers.moe import auxiliary_loss

    stats = [{"aux": jnp.float32(1.0), "z": jnp.float32(10.0)}, {"aux": jnp.float32(3.0), "z": jnp.float32(30.0)}]
    assert float(auxiliary_loss(PAD_MOE, stats)) == pytest.approx(0.01 * 2.0 + 0.001 * 20.0, rel=1e-6)
    spec = build_model(PAD_MOE, InputShape(vocab_size=64, seq_len=16))  # MoE in blocks 1 and 3
    assert spec.extras["moe_layers"] == [1, 3]
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 17), dtype=np.int32))
    loss, m = spec.objective(spec.init(0), batch)
    expected = float(m["ce"]) + 0.01 * float(m["moe/aux"]) + 0.001 * float(m["moe/z"])
    assert float(loss) == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_evaluation_padding_does_not_change_an_moe_models_scores():
    """The lm-eval adapter right-pads every window to a bucket and fills short batches with dummy
    rows: an MoE model's log-likelihoods and greedy generations are those of the unpadded sequence,
    whatever the buckets and the batch size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from evals.lm_adapter import JaxLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["the king is dead long live the queen"] * 20,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    model = build_model(PAD_MOE, InputShape(vocab_size=300, seq_len=24)).init(0)
    rng = np.random.default_rng(3)
    reqs = [
        (None, [int(t) for t in rng.integers(1, 300, n)], [int(t) for t in rng.integers(1, 300, 4)]) for n in (3, 9, 5)
    ]

    def direct(ctx, cont):  # one unpadded forward pass of exactly the request's inputs
        ids = ctx + cont
        logits = np.asarray(model(jnp.asarray([ids[:-1]], jnp.int32))[0], np.float64)
        logp = logits[np.arange(len(ids) - 1), ids[1:]] - np.log(np.exp(logits).sum(-1))
        return float(logp[len(ctx) - 1 :].sum())

    want = [direct(c, x) for _, c, x in reqs]
    for buckets, batch_size in (((24,), 4), ((8, 16, 24), 1), ((12, 24), 2)):
        got = JaxLM(model, tok, batch_size=batch_size, buckets=buckets)._loglikelihood_tokens(reqs, disable_tqdm=True)
        np.testing.assert_allclose([lp for lp, _ in got], want, rtol=1e-4, atol=1e-4, err_msg=str(buckets))
    gen = {}
    for buckets, batch_size in (((24,), 4), ((8, 16, 24), 1)):
        lm = JaxLM(model, tok, batch_size=batch_size, buckets=buckets)
        gen[buckets] = lm._generate_batch(*nnx.split(model), [(c, [], 5) for _, c, _ in reqs][:batch_size])
    assert gen[(24,)][:1] == gen[(8, 16, 24)]
