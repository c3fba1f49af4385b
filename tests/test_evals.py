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
from lm_eval.api.model import LM, TemplateLM
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from configs.eval import EvalConfig
from configs.model import DenseLMConfig, MoELMConfig
from evals.heldout_tasks import build_heldout_tasks
from evals.lm_adapter import JaxLM
from models import InputShape, build_model

MAX_LEN = 32
WORDS = [
    "hello",
    "there",
    "friend",
    "the",
    "king",
    "is",
    "dead",
    "long",
    "live",
    "the",
    "queen",
    "what",
    "say",
    "you",
    "my",
    "lord",
    "i",
    "know",
    "not",
    "sir",
    "but",
    "hark",
    "who",
    "comes",
    "here",
    "enter",
    "a",
    "messenger",
    "with",
    "letters",
    "from",
    "rome",
    "café",
    "naïve",
    "ghost",
    "night",
    "watch",
    "castle",
    "sword",
    "crown",
]


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


def _tiny_lm(seed: int = 0) -> nnx.Module:
    cfg = DenseLMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64)
    spec = build_model(cfg, InputShape(vocab_size=300, seq_len=MAX_LEN))
    return spec.init(seed)


@pytest.fixture(scope="module")
def model():
    return _tiny_lm(0)


@pytest.fixture(scope="module")
def sharp_model():
    """The tiny model with every parameter ×10: peaked, context-dependent greedy outputs (at init
    the greedy continuation just repeats one token, which would make the stop tests vacuous)."""
    m = _tiny_lm(0)
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
    ((got, greedy),) = lm.loglikelihood([_req("loglikelihood", ctx, cont)])
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


@pytest.fixture(scope="module")
def out_tok() -> Tokenizer:
    """A real byte-level BPE trained on a few strings, so that "out" is one token and "ut" is not."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    t.train_from_iterator(["out shout about out", "come out, get out"] * 20, trainer)
    return t


def test_boundary_token_spanning_the_join(model, out_tok):
    lm = JaxLM(model, out_tok, batch_size=4)
    enc = lambda s: out_tok.encode(s).ids  # noqa: E731
    assert len(enc("out")) == 1 and len(enc("ut")) == 2 and len(enc("o")) == 1
    # "o" + "ut" is one token "out": the continuation scored is still exactly "ut", given "o".
    ctx_ids, cont_ids = lm.split_pair("o", "ut")
    assert (ctx_ids, cont_ids) == (enc("o"), enc("ut"))
    ((got, _),) = lm.loglikelihood([_req("loglikelihood", "o", "ut")])
    assert got == pytest.approx(_direct(model, enc("o"), enc("ut"))[0], rel=1e-5, abs=1e-4)
    assert got != pytest.approx(_direct(model, [lm.eot_token_id], enc("out"))[0], rel=1e-5, abs=1e-4)
    # Every choice of one question is scored on the context's own ids, and each continuation's
    # ids decode to exactly that continuation, whether or not a token spans the join.
    ctx = "come out, get o"
    for cont in ("ut", "ut now", "ther", " out", "\nshout"):
        c_ids, x_ids = lm.split_pair(ctx, cont)
        assert c_ids == enc(ctx) and out_tok.decode(x_ids) == cont, cont
    # Where the join is a token boundary of the joint string, the split equals lm-eval's own
    # (HF backend) _encode_pair, including its move of the context's trailing spaces.
    for ctx, cont in (("come out,", " get out"), ("shout ", "out"), ("get", " out"), ("about", "\nout")):
        assert lm.split_pair(ctx, cont) == TemplateLM._encode_pair(lm, ctx, cont), (ctx, cont)
    assert lm.split_pair("shout ", "out") == (enc("shout"), enc(" out"))
    assert lm.split_pair("  ", "out") == ([lm.eot_token_id], enc("  out"))  # all-space context → EOT
    ((got, _),) = lm.loglikelihood([_req("loglikelihood", "shout ", "out")])
    assert got == pytest.approx(_direct(model, enc("shout"), enc(" out"))[0], rel=1e-5, abs=1e-4)


def test_boundary_multibyte_characters(lm, tok):
    for ctx, cont in (("caf", "é naïve"), ("say hello there hel", "lo friend")):
        ctx_ids, cont_ids = lm.split_pair(ctx, cont)
        assert ctx_ids == tok.encode(ctx).ids and tok.decode(cont_ids) == cont
        assert tok.decode(ctx_ids + cont_ids) == ctx + cont


def test_empty_context_uses_eot(lm, model, tok):
    cont = "the ghost"
    ((got, _),) = lm.loglikelihood([_req("loglikelihood", "", cont)])
    want, _ = _direct(model, [lm.eot_token_id], tok.encode(cont).ids)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)
    assert lm.loglikelihood([_req("loglikelihood", "abc", "")]) == [(0.0, True)]


def test_long_context_truncated_from_the_left(model, tok):
    lm = JaxLM(model, tok, batch_size=4)
    ctx = " ".join(WORDS) * 2
    cont = " the king"
    ctx_ids, cont_ids = lm.split_pair(ctx, cont)
    assert len(ctx_ids) + len(cont_ids) > MAX_LEN + 1
    keep = (ctx_ids + cont_ids)[-(MAX_LEN + 1) :]
    want, _ = _direct(model, keep[: len(keep) - len(cont_ids)], cont_ids)
    assert lm.truncated_requests == 0
    (got, _), (short, _) = lm.loglikelihood([_req("loglikelihood", ctx, cont), _req("loglikelihood", "hark", cont)])
    assert math.isfinite(got) and got == pytest.approx(want, rel=1e-5, abs=1e-4)
    assert lm.truncated_requests == 1  # counted, not silent; the short request is not
    # Exactly max_len + 1 tokens fit (the model sees max_len inputs): not truncated.
    ((got, _),) = lm._loglikelihood_tokens([(None, keep[: len(keep) - len(cont_ids)], cont_ids)])
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4) and lm.truncated_requests == 1
    lm.loglikelihood_rolling([_req("loglikelihood_rolling", ctx * 3)])  # rolling windows never truncate
    assert lm.truncated_requests == 1
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
    ((got, _),) = lm.loglikelihood([_req("loglikelihood", "hark", long_cont)])
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)
    assert lm.truncated_requests == 2


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
        results.append(
            lm.loglikelihood_rolling([_req("loglikelihood_rolling", text), _req("loglikelihood_rolling", "x")])
        )
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


def _sharp(model: nnx.Module) -> nnx.Module:
    nnx.update(model, jax.tree.map(lambda x: 10.0 * x, nnx.state(model)))
    return model


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_kv_cached_generation_is_the_full_forward_paths_token_for_token(family, tok):
    """The KV-cached decoder (models/text/generate.py) against one full forward pass per new token,
    on fixed prompts in one call: ragged prompt lengths in a batch, an empty context, a context
    longer than the window, sequences that outgrow the window while generating (handed over to
    the sliding path), stops in one token and across tokens, EOT, and max_gen_toks 0. The MoE LM
    routes dropless (each decoded token routes alone in the cached path; see the module)."""
    if family == "dense":
        model = _sharp(
            build_model(DenseLMConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64), InputShape(300, MAX_LEN)).init(1)
        )
    else:
        cfg = MoELMConfig(
            d_model=32, n_layers=2, n_heads=2, d_ff=64, n_experts=4, top_k=2, moe_every=2, capacity_factor=None
        )
        model = _sharp(build_model(cfg, InputShape(300, MAX_LEN)).init(1))
    words = " ".join(WORDS)
    contexts = ["the king is dead", "", words, words[:60], words[:90], "hello", "to be or not", words[20:50], "a"]
    free = JaxLM(model, tok, batch_size=4, kv_cache=False).generate_until(
        [_req("generate_until", c, {"until": [], "max_gen_toks": 24}) for c in contexts]
    )
    assert len({f for f in free if f}) >= 5, free  # context-dependent, not one repeated token
    stops = [f[3:5] if len(f) > 5 else "zz" for f in free]  # stops that do occur, some across tokens
    kwargs = [
        {"until": [], "max_gen_toks": 24},
        {"until": ["\n"], "max_gen_toks": 7},
        {"until": [stops[0]], "max_gen_toks": 24},
        {"until": [stops[3]], "max_gen_toks": 40},  # outgrows the 32-token window
        {"until": ["never"], "max_gen_toks": 0},
    ]
    reqs = [_req("generate_until", c, kw) for kw in kwargs for c in contexts]
    want = JaxLM(model, tok, batch_size=4, kv_cache=False).generate_until(reqs)
    got = JaxLM(model, tok, batch_size=4).generate_until(reqs)
    assert got == want
    assert got[: len(contexts)] == free and got[-len(contexts) :] == [""] * len(contexts)
    assert any(s in f and len(g) < len(f) for s, f, g in zip(stops, free, got[2 * len(contexts) :]))


def test_heldout_tasks_deterministic_and_valid(tmp_path):
    kw = dict(ppl_docs=4, ppl_chars=400, mc_questions=30, mc_context_lines=3, seed=7)
    tasks_a, info_a = build_heldout_tasks(DOCS, tmp_path / "a", **kw)
    tasks_b, info_b = build_heldout_tasks(DOCS, tmp_path / "b", **kw)
    a_mc, b_mc = open(info_a["mc_path"]).read(), open(info_b["mc_path"]).read()
    assert a_mc == b_mc and open(info_a["ppl_path"]).read() == open(info_b["ppl_path"]).read()
    _, info_c = build_heldout_tasks(DOCS, tmp_path / "c", **{**kw, "seed": 8})
    assert open(info_c["mc_path"]).read() != a_mc
    assert [t["task"] for t in tasks_a] == ["heldout_ppl", "heldout_nextline"]
    assert info_a["mc_chance"] == 0.25

    passages = [json.loads(ln) for ln in open(info_a["ppl_path"])]
    assert len(passages) == 4 and {p["title"] for p in passages} == {"alpha", "beta", "gamma"}
    for p in passages:
        assert len(p["text"]) >= 400 and p["text"] in next(d["text"] for d in DOCS if d["title"] == p["title"])

    qs = [json.loads(ln) for ln in open(info_a["mc_path"])]
    assert len(qs) == 30 and {q["title"] for q in qs} == {"alpha", "beta", "gamma"}
    lines_of = {d["title"]: [ln for ln in d["text"].split("\n") if ln.strip()] for d in DOCS}

    def windows(title: str) -> dict[str, int]:  # every 3-line window of a play → its end index
        ls = lines_of[title]
        return {"\n".join(ls[e - 3 : e]): e for e in range(3, len(ls) + 1)}

    labels = set()
    for q in qs:
        doc_lines, i = lines_of[q["title"]], q["line_index"]
        assert q["answer"] == doc_lines[i] and len(q["answer"].strip()) >= 8
        assert len(q["contexts"]) == 4 and len(set(q["contexts"])) == 4
        assert q["contexts"][q["label"]] == "\n".join(doc_lines[i - 3 : i])
        assert sorted(q["kinds"]) == ["far", "near", "other_doc", "true"] and q["kinds"][q["label"]] == "true"
        own = windows(q["title"])
        for ctx, kind in zip(q["contexts"], q["kinds"]):
            assert q["answer"].strip() not in {ln.strip() for ln in ctx.split("\n")} or kind == "true"
            if kind == "near":
                assert 6 <= i - own[ctx] <= 6 + 24
            elif kind == "far":
                assert abs(own[ctx] - i) >= 50
            elif kind == "other_doc":
                assert any(ctx in windows(t) for t in lines_of if t != q["title"])
        labels.add(q["label"])
    assert len(labels) > 1
    # A single document: the other-document distractor becomes a second far window.
    _, info_1 = build_heldout_tasks(DOCS[:1], tmp_path / "one", **kw)
    for q in map(json.loads, open(info_1["mc_path"])):
        assert sorted(q["kinds"]) == ["far", "far", "near", "true"]


class _TextLM(LM):
    """A stand-in LM scoring ``(context, continuation)`` pairs with a Python function."""

    def __init__(self, score):
        super().__init__()
        self.score = score

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return [(float(self.score(c, x)), False) for c, x in (r.args for r in requests)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return [-float(len(r.args[0])) for r in requests]

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


def test_nextline_task_scores_contexts_not_line_priors(tmp_path):
    """lm-eval runs the task as a real multiple-input task: it scores the one answer line after
    each candidate context. A model that ignores the context cannot beat its tie-break (the first
    choice), whatever it thinks of the line; a model that knows the plays gets every question."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks, info = build_heldout_tasks(
        DOCS, tmp_path, ppl_docs=2, ppl_chars=300, mc_questions=40, mc_context_lines=2, seed=3
    )
    qs = [json.loads(ln) for ln in open(info["mc_path"])]
    texts = ["\n".join(ln for ln in d["text"].split("\n") if ln.strip()) for d in DOCS]
    seen = []

    def oracle(ctx, cont):
        seen.append((ctx, cont))
        return 0.0 if any(ctx + cont in t for t in texts) else -1.0

    def run(score):
        res = lm_eval.simple_evaluate(
            model=_TextLM(score),
            tasks=[tasks[1]],
            task_manager=TaskManager(include_defaults=False),
            num_fewshot=0,
            bootstrap_iters=0,
            log_samples=False,
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
        )
        return res["results"]["heldout_nextline"]["acc,none"]

    assert run(oracle) == 1.0
    assert sorted(seen) == sorted((c, "\n" + q["answer"]) for q in qs for c in q["contexts"])
    blind = run(lambda ctx, cont: -len(cont) + math.sin(len(cont)))  # a line prior, blind to the context
    assert blind == pytest.approx(sum(q["label"] == 0 for q in qs) / len(qs))


def test_lm_eval_bootstrap_runs_in_process(monkeypatch):
    """lm-eval's bootstrap would fork a multiprocessing Pool; evaluate_lm's guard keeps it in-process."""
    import multiprocessing

    from lm_eval.api import metrics as lm_metrics

    from evals.run_eval import _no_multiprocessing

    def no_pool(*a, **k):
        raise AssertionError("multiprocessing.Pool used")

    monkeypatch.setattr(multiprocessing, "Pool", no_pool)
    monkeypatch.delenv("DISABLE_MULTIPROC", raising=False)
    items = [(-10.0 - i, 7 + i % 3) for i in range(8)]
    with pytest.raises(AssertionError, match="Pool"):
        lm_metrics.bootstrap_stderr(lm_metrics.bits_per_byte, items, iters=100)
    with _no_multiprocessing():
        se = lm_metrics.bootstrap_stderr(lm_metrics.bits_per_byte, items, iters=100)
    assert se > 0 and "DISABLE_MULTIPROC" not in os.environ


def test_evaluate_lm_end_to_end(tmp_path, model, tok, monkeypatch, capfd):
    import multiprocessing

    from evals.run_eval import evaluate_lm

    def no_fork(*a, **k):
        raise AssertionError("evaluate_lm forked")

    monkeypatch.setattr(multiprocessing, "Pool", no_fork)
    monkeypatch.setattr(os, "fork", no_fork)
    monkeypatch.delenv("DISABLE_MULTIPROC", raising=False)
    cfg = EvalConfig(ppl_docs=3, ppl_chars=300, mc_questions=12, mc_context_lines=3, batch_size=8)
    capfd.readouterr()
    flat = evaluate_lm(model, tok, DOCS, tmp_path, cfg, seed=0, name="tiny")
    # quiet unless eval.verbose: none of our bars, the datasets library's or lm-eval's prints (lm-eval's
    # own request bars follow TQDM_DISABLE, which ddiloco and the deployments' environment set)
    out, err = capfd.readouterr()
    for noise in ("loglikelihood:", "generate_until:", "Generating test split", "bootstrapping for stddev"):
        assert noise not in out + err, (out + err)[-2000:]
    for k in (
        "heldout_ppl/word_perplexity",
        "heldout_ppl/byte_perplexity",
        "heldout_ppl/bits_per_byte",
        "heldout_nextline/acc",
        "eval_s",
    ):
        assert math.isfinite(flat[k]), k
    for k in (
        "heldout_ppl/word_perplexity",
        "heldout_ppl/byte_perplexity",
        "heldout_ppl/bits_per_byte",
        "heldout_nextline/acc",
    ):
        assert isinstance(flat[f"{k}_stderr"], float) and flat[f"{k}_stderr"] > 0, k
    assert 0.0 <= flat["heldout_nextline/acc"] <= 1.0 and flat["heldout_nextline/chance"] == 0.25
    assert flat["heldout_ppl/byte_perplexity"] > 1.0
    assert flat["heldout_ppl/bits_per_byte"] == pytest.approx(math.log2(flat["heldout_ppl/byte_perplexity"]), rel=1e-6)
    saved = json.loads((tmp_path / "tiny.json").read_text())
    res = saved["results"]["heldout_nextline"]
    assert res["acc,none"] == flat["heldout_nextline/acc"]
    n = flat["heldout_nextline/questions"]  # lm-eval's closed-form stderr of a mean of 0/1 scores
    acc = flat["heldout_nextline/acc"]
    assert flat["heldout_nextline/acc_stderr"] == pytest.approx(math.sqrt(acc * (1 - acc) / (n - 1)), rel=1e-9)
    assert set(saved["heldout_nextline_by_kind"]) == {"near", "far", "other_doc"}
    # Truncation is counted, not silent: every (context, "\n" + answer) pair longer than the window.
    lm = JaxLM(model, tok)
    qs = [json.loads(ln) for ln in open(saved["task_files"]["mc_path"])]
    want = sum(len(sum(lm.split_pair(c, "\n" + q["answer"]), [])) > MAX_LEN + 1 for q in qs for c in q["contexts"])
    assert want > 0 and flat["truncated_requests"] == want and isinstance(flat["truncated_requests"], int)
