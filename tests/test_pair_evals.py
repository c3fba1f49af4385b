"""Tests for the prompt/response pair evaluation (``evals/pair_tasks.py``) on a tiny model.

Every per-item score that comes back from lm-eval is checked against the adapter called directly:
``JaxLM.generate_until`` for exact match, ``JaxLM.loglikelihood`` / ``split_pair`` for the NLL.
"""

from __future__ import annotations

import json
import math
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import pytest
from flax import nnx
from lm_eval.api.instance import Instance

from configs.model import DenseLMConfig
from data.text import train_tokenizer
from evals.lm_adapter import JaxLM
from evals.pair_tasks import build_pair_tasks, evaluate_pairs
from models import InputShape, build_model

MAX_LEN = 32
MAX_GEN = 6
TEXT = [
    "OLIVER. Who speaks there?\nORLANDO. I, my brother.\nADAM. Good master, hark.\n",
    "ROSALIND. What say you now?\nCELIA. Nothing, cousin.\nTOUCHSTONE. Peace, fool.\n",
] * 10


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXT, vocab_size=300)


@pytest.fixture(scope="module")
def model():
    """A 1-layer dense LM with every parameter ×10: peaked, context-dependent greedy outputs."""
    cfg = DenseLMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64)
    m = build_model(cfg, InputShape(vocab_size=300, seq_len=MAX_LEN)).init(0)
    nnx.update(m, jax.tree.map(lambda x: 10.0 * x, nnx.state(m)))
    return m


def _req(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


def test_evaluate_pairs_matches_the_adapter(tmp_path, model, tok):
    lm = JaxLM(model, tok, batch_size=4)
    gen_kw = {"until": ["\n"], "max_gen_toks": MAX_GEN, "do_sample": False}
    own_prompt = "OLIVER. Who speaks there?\n"
    greedy = lm.generate_until([_req("generate_until", own_prompt, gen_kw)])[0]
    assert greedy.strip(), "the model's greedy output must be non-blank to serve as a response"
    pairs = [
        {"id": "p0", "prompt": "ROSALIND. What say you now?\n", "response": "CELIA. Nothing, cousin.\n"},
        {"id": "p1", "prompt": own_prompt, "response": greedy + "\n"},  # the model's own answer
        {"id": "p2", "prompt": "Good {{ master }}", "response": ", hark.\n"},  # no Jinja: verbatim
        {"id": "p3", "prompt": "", "response": " ADAM.\n"},  # empty prompt: EOT is the context
    ]
    out = evaluate_pairs(model, tok, pairs, tmp_path, batch_size=4, max_gen_toks=MAX_GEN)
    m, per = out["metrics"], out["per_item"]
    assert set(out) == {"metrics", "per_item"}
    assert set(m) == {"exact_match", "exact_match_stderr", "response_nll", "response_greedy", "items", "eval_s"}
    assert set(per) == {"exact_match", "response_nll", "generated"}
    assert m["items"] == 4 and all(len(v) == 4 for v in per.values())

    # Exact match: per item, the adapter's own greedy decode, stripped, against the stripped response.
    direct_gen = lm.generate_until([_req("generate_until", p["prompt"], gen_kw) for p in pairs])
    assert per["generated"] == direct_gen
    want = [float(g.strip() == p["response"].strip()) for g, p in zip(direct_gen, pairs)]
    assert per["exact_match"] == want == [0.0, 1.0, 0.0, 0.0]
    assert m["exact_match"] == pytest.approx(sum(want) / 4)
    assert m["exact_match_stderr"] == pytest.approx((0.25 * 0.75 / 3) ** 0.5)  # lm-eval's mean_stderr

    # NLL: -log p(response | prompt) per continuation token, from the adapter directly.
    direct = lm.loglikelihood([_req("loglikelihood", p["prompt"], p["response"]) for p in pairs])
    n_tok = [len(lm.split_pair(p["prompt"], p["response"])[1]) for p in pairs]
    want_nll = [-ll / n for (ll, _), n in zip(direct, n_tok)]
    assert per["response_nll"] == pytest.approx(want_nll, rel=1e-5, abs=1e-5)
    assert m["response_nll"] == pytest.approx(sum(want_nll) / 4, rel=1e-5)
    assert m["response_greedy"] == pytest.approx(sum(g for _, g in direct) / 4)
    # (Not asserted: that the model's own answer is greedy under teacher forcing. This random model
    # emits lone bytes that decode to U+FFFD, which re-encodes to other tokens.)
    assert m["eval_s"] > 0

    saved = json.loads((tmp_path / "pair_eval.json").read_text())
    assert "samples" not in saved and set(saved["results"]) == {"ft_generate", "ft_loglik"}
    assert saved["results"]["ft_generate"]["exact_match,strip"] == m["exact_match"]
    assert [(it["id"], it["generated"]) for it in saved["items"]] == [(p["id"], g) for p, g in zip(pairs, direct_gen)]
    assert saved["metrics"]["response_nll"] == m["response_nll"]
    # lm-eval's perplexity metric, aggregated overflow-safely (lm-eval's own aggregation and its
    # bootstrap stderr raise OverflowError at this sharp model's NLLs of hundreds of nats).
    mean_nll = -sum(ll for ll, _ in direct) / 4
    assert mean_nll > 355
    ppl = saved["results"]["ft_loglik"]["perplexity,none"]
    assert ppl is None if mean_nll >= 709 else ppl == pytest.approx(math.exp(mean_nll), rel=1e-4)


def test_build_pair_tasks_config_and_file(tmp_path):
    pairs = [{"id": 7, "prompt": "Who?\n", "response": " HAMLET\n"}, {"id": "b", "prompt": "x", "response": "y\n"}]
    (gen, ll), info = build_pair_tasks(pairs, tmp_path, max_gen_toks=5)
    assert info == {"path": str((tmp_path / "pairs.jsonl").resolve()), "pairs": 2}
    rows = [json.loads(ln) for ln in open(info["path"])]
    assert rows[0] == {"id": "7", "prompt": "Who?\n", "response": " HAMLET\n", "target": "HAMLET"}
    assert not (tmp_path / "pairs.jsonl.tmp").exists()
    assert gen["output_type"] == "generate_until" and ll["output_type"] == "loglikelihood"
    assert gen["generation_kwargs"] == {"until": ["\n"], "max_gen_toks": 5, "do_sample": False}
    assert (gen["doc_to_text"], gen["doc_to_target"], ll["doc_to_target"]) == ("prompt", "target", "response")
    assert gen["target_delimiter"] == ll["target_delimiter"] == "" and gen["num_fewshot"] == ll["num_fewshot"] == 0
    assert [x["metric"] for x in ll["metric_list"]] == ["perplexity", "acc"]
    # The datasets cache is keyed on the file's content: new pairs never read a stale cache.
    (gen2, _), _ = build_pair_tasks(pairs[:1], tmp_path)
    assert gen2["dataset_kwargs"]["cache_dir"] != gen["dataset_kwargs"]["cache_dir"]


@pytest.mark.parametrize(
    "pairs, match",
    [
        ([], "no prompt/response pairs"),
        ([{"id": "a", "prompt": "Who?\n"}], "no 'response' field"),
        ([{"id": "a", "response": " A\n"}], "no 'prompt' field"),
        ([{"id": "a", "prompt": "Who?\n", "response": ""}], "empty response"),
        ([{"id": "a", "prompt": "Who?\n", "response": " \n"}], "empty response"),
        (
            [{"id": "a", "prompt": "Q", "response": "A\n"}, {"id": "a", "prompt": "R", "response": "B\n"}],
            "duplicate id",
        ),
    ],
)
def test_bad_pairs_raise(tmp_path, pairs, match):
    with pytest.raises(ValueError, match=match):
        build_pair_tasks(pairs, tmp_path)
    with pytest.raises(ValueError, match=match):  # before any model work
        evaluate_pairs(None, None, pairs, tmp_path)
