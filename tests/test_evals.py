"""Tests for the lm-eval adapter and the held-out tasks, on a tiny model and a tiny BPE tokenizer.

Every score is checked against a direct computation from the model's logits (unpadded, unbatched,
float64 log-softmax), including the cases adapters get wrong: a BPE token spanning the
context/continuation join, an empty context, inputs longer than the window, stop sequences.
"""

from __future__ import annotations

import json
import math
import os
import random

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lm_eval.api.instance import Instance
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from configs.schema import EvalConfig, ModelConfig
from evals.heldout_tasks import build_heldout_tasks
from evals.lm_adapter import JaxLM
from models import build_model

MAX_LEN = 32
WORDS = (
    "hello there friend the king is dead long live the queen what say you my lord "
    "i know not sir but hark who comes here enter a messenger with letters from rome "
    "café naïve ghost night watch castle sword crown"
).split()


def _play(title: str, seed: int, n_lines: int = 120) -> dict:
    rng = random.Random(seed)
    speakers = ["Ham.", "Hor.", "King.", "Queen.", "Ghost."]
    lines = [title.upper(), ""]
    for i in range(n_lines):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
        lines.append(f"  {rng.choice(speakers)} {words.capitalize()}" if i % 3 == 0 else words)
        if i % 5 == 4:
            lines.append("")
    return {"title": title, "text": "\n".join(lines)}


DOCS = [_play("alpha", 1), _play("beta", 2), _play("gamma", 3)]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    t.train_from_iterator([d["text"] for d in DOCS] + ["hello hello hello world"] * 50, trainer)
    return t


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64)
    return build_model(cfg, 300, max_len=MAX_LEN, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def sharp_model():
    """The tiny model with every parameter ×10: peaked, context-dependent greedy outputs (at init
    the greedy continuation just repeats one token, which would make the stop tests vacuous)."""
    m = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64), 300, max_len=MAX_LEN, rngs=nnx.Rngs(0))
    nnx.update(m, jax.tree.map(lambda x: 10.0 * x, nnx.state(m)))
    return m


@pytest.fixture(scope="module")
def lm(model, tok) -> JaxLM:
    return JaxLM(model, tok, batch_size=4)


def _req(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


@nnx.jit
def _forward(model, ids_BL):
    return model(ids_BL)


def _logits(model, ids: list[int]) -> np.ndarray:
    """float64 logits ``[len(ids), V]`` from one unbatched, unpadded forward pass."""
    return np.asarray(_forward(model, jnp.asarray([ids], jnp.int32))[0], np.float64)


def _logp(model, ids: list[int]) -> np.ndarray:
    """float64 log p(ids[t+1] | ids[:t+1]) for t < len(ids)-1, from one unpadded forward pass."""
    logits = _logits(model, ids[:-1])
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return logits[np.arange(len(ids) - 1), ids[1:]] - logz


def _direct(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    ids = ctx + cont
    lp = _logp(model, ids)[len(ctx) - 1 :]
    logits = _logits(model, ids[:-1])
    greedy = all(int(np.argmax(logits[len(ctx) - 1 + i])) == t for i, t in enumerate(cont))
    return float(lp.sum()), greedy


def test_loglikelihood_matches_hand_computation(lm, model, sharp_model, tok):
    ctx, cont = "the king is dead", " long live the queen"
    ctx_ids, cont_ids = tok.encode(ctx).ids, tok.encode(cont).ids
    assert tok.encode(ctx + cont).ids == ctx_ids + cont_ids  # no token spans this join
    want, want_greedy = _direct(model, ctx_ids, cont_ids)
    (got, greedy), = lm.loglikelihood([_req("loglikelihood", ctx, cont)])
    assert isinstance(got, float) and isinstance(greedy, bool)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)
    assert greedy == want_greedy
    # is_greedy is a real argmax check: the model's own greedy token must come back True.
    sharp = JaxLM(sharp_model, tok, batch_size=4)
    ids = tok.encode(ctx).ids
    first = int(np.argmax(_logits(sharp_model, ids)[-1]))
    second = int(np.argmax(_logits(sharp_model, ids + [first])[-1]))
    (_, g1), (_, g2), (_, g3) = sharp._loglikelihood_tokens(
        [(None, ids, [first, second]), (None, ids, [first, (second + 1) % 300]), (None, ids, [(first + 1) % 300])]
    )
    assert (g1, g2, g3) == (True, False, False)


def test_boundary_token_spanning_the_join(lm, model, tok):
    assert len(tok.encode("hello").ids) == 1 and len(tok.encode("hel").ids) >= 1
    # "hel" + "lo" is one token "hello": the continuation owns it, conditioned on EOT.
    (got, _), = lm.loglikelihood([_req("loglikelihood", "hel", "lo")])
    want, _ = _direct(model, [lm.eot_token_id], tok.encode("hello").ids)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)
    (empty_ctx, _), = lm.loglikelihood([_req("loglikelihood", "", "hello")])
    assert got == pytest.approx(empty_ctx, rel=1e-6)
    # A longer context: the joint string's tokens after the last boundary inside the context.
    ctx, cont = "say hello there hel", "lo friend"
    whole = tok.encode(ctx + cont).ids
    ctx_ids, cont_ids = lm.split_pair(ctx, cont)
    assert ctx_ids + cont_ids == whole
    assert tok.decode(cont_ids).endswith(cont) and tok.decode(ctx_ids) + tok.decode(cont_ids) == ctx + cont
    assert len(tok.decode(cont_ids)) > len(cont)  # the spanning token carries "hel" with it
    (got, _), = lm.loglikelihood([_req("loglikelihood", ctx, cont)])
    assert got == pytest.approx(_direct(model, ctx_ids, cont_ids)[0], rel=1e-5, abs=1e-4)
    # Multi-byte characters split across tokens still add up in bytes.
    ctx_ids, cont_ids = lm.split_pair("caf", "é naïve")
    assert tok.decode(ctx_ids + cont_ids) == "café naïve"


def test_empty_context_uses_eot(lm, model, tok):
    cont = "the ghost"
    (got, _), = lm.loglikelihood([_req("loglikelihood", "", cont)])
    want, _ = _direct(model, [lm.eot_token_id], tok.encode(cont).ids)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)
    assert lm.loglikelihood([_req("loglikelihood", "abc", "")]) == [(0.0, True)]


def test_long_context_truncated_from_the_left(lm, model, tok):
    ctx = " ".join(WORDS) * 2
    cont = " the king"
    ctx_ids, cont_ids = lm.split_pair(ctx, cont)
    assert len(ctx_ids) + len(cont_ids) > MAX_LEN + 1
    keep = (ctx_ids + cont_ids)[-(MAX_LEN + 1) :]
    want, _ = _direct(model, keep[: len(keep) - len(cont_ids)], cont_ids)
    (got, _), = lm.loglikelihood([_req("loglikelihood", ctx, cont)])
    assert math.isfinite(got) and got == pytest.approx(want, rel=1e-5, abs=1e-4)
    # A continuation longer than the window is scored in chunks, each with maximal left context.
    long_cont = " " + " ".join(WORDS)
    c_ids, x_ids = lm.split_pair("hark", long_cont)
    assert len(x_ids) > MAX_LEN
    full = c_ids + x_ids
    want = 0.0
    for a in range(len(c_ids), len(full), MAX_LEN):
        b = min(a + MAX_LEN, len(full))
        s = max(0, b - 1 - MAX_LEN)
        want += _logp(model, full[s:b])[-(b - a) :].sum()
    (got, _), = lm.loglikelihood([_req("loglikelihood", "hark", long_cont)])
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)


def test_loglikelihood_rolling_windows_and_batch_size(model, tok):
    text = DOCS[0]["text"][:600]
    toks = tok.encode(text).ids
    n, L = len(toks), MAX_LEN
    assert n > 2 * L
    # Disjoint windows by hand: [EOT]+t[:L-1] predicts t[:L]; then t[kL-1:(k+1)L-1] predicts
    # t[kL:(k+1)L]; the last partial window predicts its p tokens from the L tokens before them.
    want = _logp(model, [0] + toks[:L]).sum()
    pos = L
    while pos < n:
        p = min(L, n - pos)
        want += _logp(model, toks[pos + p - L - 1 : pos + p])[-p:].sum()
        pos += p
    results = []
    for bs in (1, 3, 4):
        lm = JaxLM(model, tok, batch_size=bs)
        results.append(lm.loglikelihood_rolling([_req("loglikelihood_rolling", text), _req("loglikelihood_rolling", "x")]))
    assert results[0][0] == pytest.approx(want, rel=1e-5, abs=1e-4)
    for r in results[1:]:
        assert r == pytest.approx(results[0], rel=1e-6, abs=1e-5)
    assert lm.loglikelihood_rolling([_req("loglikelihood_rolling", "")]) == [0.0]


def _hand_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding, one token at a time, on the last MAX_LEN tokens (right-padded to MAX_LEN so
    the reference compiles once; causality makes the padding irrelevant, which the exact-length
    references of the scoring tests check)."""
    ids = list(ids)
    out = []
    for _ in range(n):
        window = ids[-MAX_LEN:]
        logits = np.asarray(_forward(model, jnp.asarray([window + [0] * (MAX_LEN - len(window))], jnp.int32))[0])
        nxt = int(np.argmax(logits[len(window) - 1]))
        if nxt == 0:
            break
        out.append(nxt)
        ids.append(nxt)
    return out


def test_generate_until(sharp_model, tok):
    model, lm = sharp_model, JaxLM(sharp_model, tok, batch_size=4)
    ctx = "the king is dead"
    gen = lambda kw, c=ctx: lm.generate_until([_req("generate_until", c, kw)])[0]  # noqa: E731
    hand_ids = _hand_greedy(model, tok.encode(ctx).ids, 12)
    assert len(hand_ids) == 12  # no EOT: max_gen_toks is what ends these
    hand = tok.decode(hand_ids)
    free = gen({"until": [], "max_gen_toks": 12})
    assert free == hand
    assert gen({"max_gen_toks": 3}) == tok.decode(hand_ids[:3]) != hand
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert free.find(stop) > 0
    cut = gen({"until": ["never-there", stop], "max_gen_toks": 12, "do_sample": False})
    assert cut == free[: free.find(stop)] and stop not in cut
    assert gen({"until": stop, "max_gen_toks": 12}) == cut  # a bare string works too
    # Batched, with a context longer than the window and an empty context, in one call.
    long_ctx = " ".join(WORDS) * 2
    outs = lm.generate_until(
        [_req("generate_until", c, {"until": ["\n"], "max_gen_toks": 5}) for c in (ctx, long_ctx, "")]
    )
    assert outs[0] == hand[: len(outs[0])] and all("\n" not in o for o in outs)
    assert outs[1] == tok.decode(_hand_greedy(model, tok.encode(long_ctx).ids, 5)).split("\n")[0]
    with pytest.raises(ValueError, match="greedy"):
        gen({"do_sample": True, "temperature": 1.0})


def test_heldout_tasks_deterministic_and_valid(tmp_path):
    kw = dict(ppl_docs=4, ppl_chars=400, mc_questions=30, mc_context_lines=3, seed=7)
    tasks_a, info_a = build_heldout_tasks(DOCS, tmp_path / "a", **kw)
    tasks_b, info_b = build_heldout_tasks(DOCS, tmp_path / "b", **kw)
    a_mc, b_mc = open(info_a["mc_path"]).read(), open(info_b["mc_path"]).read()
    assert a_mc == b_mc and open(info_a["ppl_path"]).read() == open(info_b["ppl_path"]).read()
    _, info_c = build_heldout_tasks(DOCS, tmp_path / "c", **{**kw, "seed": 8})
    assert open(info_c["mc_path"]).read() != a_mc
    assert [t["task"] for t in tasks_a] == ["heldout_ppl", "heldout_nextline"]

    passages = [json.loads(ln) for ln in open(info_a["ppl_path"])]
    assert len(passages) == 4 and {p["title"] for p in passages} == {"alpha", "beta", "gamma"}
    for p in passages:
        assert len(p["text"]) >= 400 and p["text"] in next(d["text"] for d in DOCS if d["title"] == p["title"])

    qs = [json.loads(ln) for ln in open(info_a["mc_path"])]
    assert len(qs) == 30 and {q["title"] for q in qs} == {"alpha", "beta", "gamma"}
    labels = set()
    for q in qs:
        doc_lines = [ln for ln in next(d["text"] for d in DOCS if d["title"] == q["title"]).split("\n") if ln.strip()]
        i = q["line_index"]
        assert q["question"] == "\n".join(doc_lines[i - 3 : i])
        assert len(q["choices"]) == 4 and len({c.strip() for c in q["choices"]}) == 4
        assert [c == doc_lines[i] for c in q["choices"]].count(True) == 1
        assert q["choices"][q["label"]] == doc_lines[i]
        assert all(c in doc_lines for c in q["choices"])  # distractors: real lines of the same play
        labels.add(q["label"])
    assert len(labels) > 1


def test_evaluate_lm_end_to_end(tmp_path, model, tok):
    from evals.run_eval import evaluate_lm

    cfg = EvalConfig(ppl_docs=3, ppl_chars=300, mc_questions=12, mc_context_lines=2, batch_size=8)
    flat = evaluate_lm(model, tok, DOCS, tmp_path, cfg, seed=0, name="tiny")
    for k in ("heldout_ppl/word_perplexity", "heldout_ppl/byte_perplexity", "heldout_ppl/bits_per_byte",
              "heldout_nextline/acc", "heldout_nextline/acc_norm", "eval_s"):
        assert math.isfinite(flat[k]), k
    assert 0.0 <= flat["heldout_nextline/acc"] <= 1.0 and 0.0 <= flat["heldout_nextline/acc_norm"] <= 1.0
    assert flat["heldout_ppl/byte_perplexity"] > 1.0
    assert flat["heldout_ppl/bits_per_byte"] == pytest.approx(math.log2(flat["heldout_ppl/byte_perplexity"]), rel=1e-6)
    saved = json.loads((tmp_path / "tiny.json").read_text())
    assert saved["results"]["heldout_nextline"]["acc,none"] == flat["heldout_nextline/acc"]
