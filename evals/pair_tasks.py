"""Evaluate a text model on held-out prompt/response pairs through lm-eval-harness, offline.

A pair is ``{"id": str, "prompt": str, "response": str}``: ``response`` is the exact text that
follows ``prompt`` (prompt ``"…\\nWho speaks?\\n"``, response ``" OLIVER\\n"``; responses end with
``"\\n"``). :func:`build_pair_tasks` writes them to ``pairs.jsonl`` and makes two zero-shot lm-eval
tasks from that file (``dataset_path: json``, like :mod:`evals.heldout_tasks`):

* ``ft_generate`` (``generate_until``): the model decodes greedily after the prompt until ``"\\n"``
  (or ``max_gen_toks`` new tokens, or EOT); metric ``exact_match``: 1 iff
  ``generated.strip() == response.strip()``. This is the behaviour fine-tuning is for: does the
  model *produce* the answer, in the format, on its own. It is all-or-nothing per item, so it says
  nothing about a model that is getting closer but not there yet, e.g. one that does not yet
  produce the format at all.
* ``ft_loglik`` (``loglikelihood``): the log-likelihood of the reference response, verbatim, given
  the prompt (teacher forcing); metrics ``perplexity`` (lm-eval's metric, ``exp(-mean total
  log-likelihood per response)``, with an overflow-safe copy of lm-eval's aggregation, see
  :func:`response_perplexity`) and ``acc`` (lm-eval's is-greedy: every response token is the
  model's argmax).
  :func:`evaluate_pairs` turns the per-item log-likelihoods into ``response_nll``, nats per
  response token, a smooth measure that also moves for a model that cannot yet produce the format.

How ``exact_match`` is set up in lm-eval: the reference (``doc_to_target``) is the field
``target`` = ``response.strip()`` (written to the JSONL file next to the verbatim ``response``); the
generation goes through the filter pipeline ``strip`` = lm-eval's ``remove_whitespace``
(``str.strip()`` of each generation) then ``take_first``; lm-eval's own ``exact_match`` metric
(``exact_match_hf_evaluate``: ``predictions == references``) runs with ``ignore_case``,
``ignore_punctuation`` and ``ignore_numbers`` all false and no ``regexes_to_ignore``. Its result
keys are therefore ``exact_match,strip`` / ``exact_match_stderr,strip``.

Field names are used verbatim by lm-eval (``doc_to_text: "prompt"`` is a dataset column, not a
Jinja template), and ``target_delimiter`` is ``""``: nothing is inserted between prompt and response.
:func:`evaluate_pairs` checks the requests lm-eval actually made against the pairs (a changed
lm-eval that inserted a delimiter or rewrote a prompt would fail loudly, not skew the scores).

As in :mod:`evals.run_eval`, ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` are set (if unset) before
``datasets``/``lm_eval`` are imported, and lm-eval runs with ``DISABLE_MULTIPROC=1``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


from evals.lm_adapter import JaxLM  # noqa: E402
from evals.run_eval import _jsonable, _no_multiprocessing, _stderr, run_local_tasks  # noqa: E402
from run import atomic  # noqa: E402

GEN_TASK = "ft_generate"
LL_TASK = "ft_loglik"
GEN_FILTER = "strip"  # lm-eval filter pipeline name: results key "exact_match,strip"
STOP = "\n"
PAIRS_FILE = "pairs.jsonl"
RESULTS_FILE = "pair_eval.json"

log = logging.getLogger(__name__)


def response_perplexity(items: list[float]) -> float:
    """lm-eval's ``perplexity`` aggregation, ``exp(-mean(items))`` over per-response total
    log-likelihoods (nats), but ``inf`` where that overflows instead of raising.

    lm-eval's own ``perplexity`` aggregation raises ``OverflowError`` once the mean total NLL of a
    response passes ~709 nats, and the bootstrap lm-eval then runs for its stderr (it is on
    lm-eval's bootstrappable list) squares the resampled perplexities, which overflows from ~355
    nats: long responses on an untrained model reach that, and the error would abort the whole
    ``simple_evaluate``. As a callable not on that list, this aggregation gets no stderr
    (``"N/A"``); the per-token ``response_nll`` of :func:`evaluate_pairs` is the metric to read.
    """
    m = -sum(items) / len(items)
    return math.exp(m) if m < 709.0 else math.inf


def _check_pairs(pairs: list[dict]) -> list[dict]:
    """The JSONL rows ``{"id", "prompt", "response", "target"}`` for ``pairs`` (ids as strings)."""
    if not pairs:
        raise ValueError("no prompt/response pairs given")
    rows, seen = [], set()
    for i, p in enumerate(pairs):
        if not isinstance(p, dict):
            raise ValueError(f"pair {i} is not a dict: {type(p).__name__}")
        for key in ("id", "prompt", "response"):
            if key not in p:
                raise ValueError(f"pair {i} (id {p.get('id')!r}) has no {key!r} field")
        for key in ("prompt", "response"):
            if not isinstance(p[key], str):
                raise ValueError(f"pair {i} (id {p['id']!r}): {key!r} must be a str, got {type(p[key]).__name__}")
        if not p["response"].strip():
            raise ValueError(f"pair {i} (id {p['id']!r}) has an empty response {p['response']!r}")
        pid = str(p["id"])
        if pid in seen:
            raise ValueError(f"pair {i}: duplicate id {pid!r} (ids match lm-eval's samples back to pairs)")
        seen.add(pid)
        rows.append({"id": pid, "prompt": p["prompt"], "response": p["response"], "target": p["response"].strip()})
    return rows


def build_pair_tasks(pairs: list[dict], out_dir: str | Path, max_gen_toks: int = 16) -> tuple[list[dict], dict]:
    """Write ``out_dir/pairs.jsonl`` and return the ``ft_generate`` and ``ft_loglik`` task configs.

    Args:
      pairs: ``[{"id", "prompt": str, "response": str}]``; ids unique (compared as ``str(id)``),
        responses verbatim continuations of their prompts (not stripped; a response should end with
        ``"\\n"`` and have no other newline: generation stops at the first ``"\\n"``, so a
        multi-line response can never be matched exactly).
      out_dir: folder for the JSONL file (created; the file is replaced atomically) and the
        ``datasets`` cache of the tasks (``out_dir/hf_cache/<content hash>``, private to this file
        content, so a rewrite of ``pairs.jsonl`` is never served from a stale cache).
      max_gen_toks: cap on generated tokens per item in ``ft_generate``.

    Returns:
      ``(task_configs, info)``: ``[ft_generate_cfg, ft_loglik_cfg]`` (lm-eval task config dicts with
      an absolute data path; pass them as ``tasks=`` to ``lm_eval.simple_evaluate`` with
      ``TaskManager(include_defaults=False)``), and ``info = {"path": str, "pairs": int}``.

    Raises:
      ValueError: if ``pairs`` is empty, a pair is not a dict or lacks ``id``/``prompt``/``response``,
        a prompt or response is not a str, a response is empty or all whitespace, two ids are equal,
        or ``max_gen_toks < 1``.
    """
    rows = _check_pairs(pairs)
    if int(max_gen_toks) < 1:
        raise ValueError(f"max_gen_toks must be ≥ 1, got {max_gen_toks}")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PAIRS_FILE
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    atomic.write_text(path, text)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    dataset = {
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {"test": str(path)}, "cache_dir": str(out_dir / "hf_cache" / digest)},
        "test_split": "test",
        "num_fewshot": 0,
        "doc_to_text": "prompt",  # field names: used verbatim, no Jinja rendering
        "target_delimiter": "",  # nothing between prompt and response
    }
    gen_cfg = {
        "task": GEN_TASK,
        **dataset,
        "output_type": "generate_until",
        "doc_to_target": "target",  # response.strip()
        "generation_kwargs": {"until": [STOP], "max_gen_toks": int(max_gen_toks), "do_sample": False},
        "filter_list": [
            {"name": GEN_FILTER, "filter": [{"function": "remove_whitespace"}, {"function": "take_first"}]}
        ],
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": False,
                "ignore_punctuation": False,
                "ignore_numbers": False,
            }
        ],
        "metadata": {"version": 1.0, "max_gen_toks": int(max_gen_toks)},
    }
    ll_cfg = {
        "task": LL_TASK,
        **dataset,
        "output_type": "loglikelihood",
        "doc_to_target": "response",  # verbatim
        "metric_list": [
            # lm-eval's per-item `perplexity` (the total log-likelihood), aggregated by lm-eval's
            # formula exp(-mean) made overflow-safe; see response_perplexity.
            {"metric": "perplexity", "aggregation": response_perplexity, "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }
    return [gen_cfg, ll_cfg], {"path": str(path), "pairs": len(rows)}


def _by_id(samples: list[dict], task: str, ids: list[str], filt: str) -> dict[str, dict]:
    """lm-eval's logged samples of ``task`` (filter ``filt``), keyed by the doc's ``id``; every id once."""
    out: dict[str, dict] = {}
    for s in samples:
        if s.get("filter") != filt:
            continue
        pid = str(s["doc"]["id"])
        if pid in out:
            raise RuntimeError(f"lm-eval logged pair {pid!r} twice in {task}")
        out[pid] = s
    missing = [i for i in ids if i not in out]
    if missing or len(out) != len(ids):
        raise RuntimeError(
            f"lm-eval's {task} samples do not match the pairs (missing {missing[:5]}, {len(out)} logged)"
        )
    return out


def evaluate_pairs(
    model,
    tokenizer,
    pairs: list[dict],
    out_dir: str | Path,
    *,
    batch_size: int = 32,
    max_gen_toks: int = 16,
    seed: int = 0,
) -> dict:
    """Run ``ft_generate`` and ``ft_loglik`` (lm-eval, zero-shot) on ``model`` over ``pairs``.

    Args:
      model: NNX LM, ``model(ids_BL int32) -> logits_BLV float32``, with ``max_len``.
      tokenizer: the run's byte-level BPE ``tokenizers.Tokenizer`` (with ``<|endoftext|>``).
      pairs: ``[{"id", "prompt", "response"}]`` (see :func:`build_pair_tasks`).
      out_dir: folder for ``pairs.jsonl``, the ``datasets`` cache and ``pair_eval.json``.
      batch_size: rows per forward pass of :class:`~evals.lm_adapter.JaxLM`.
      max_gen_toks: cap on generated tokens per item (greedy decoding stops earlier at ``"\\n"``/EOT).
      seed: lm-eval's seeds (nothing here is random: zero-shot, greedy).

    Returns:
      ``{"metrics": {...}, "per_item": {...}}`` with

      * ``metrics["exact_match"]`` (float in [0, 1]): mean over items of
        ``generated.strip() == response.strip()``; ``metrics["exact_match_stderr"]``: lm-eval's
        closed-form ``mean_stderr`` (``None`` with fewer than 2 items);
      * ``metrics["response_nll"]`` (nats per response token): mean over items of
        ``-log p(response | prompt) / n_tokens``, with ``n_tokens`` the continuation length of
        ``JaxLM.split_pair(prompt, response)``. As in lm-eval's HF backend, trailing whitespace of
        the prompt is moved to the front of the response before scoring, so a prompt ending in
        ``"\\n"`` has that ``"\\n"`` scored (and counted) as part of the response;
      * ``metrics["response_greedy"]`` (float in [0, 1]): lm-eval's ``acc`` for ``ft_loglik``, the
        fraction of responses whose every token is the model's argmax;
      * ``metrics["items"]`` (int) and ``metrics["eval_s"]`` (wall seconds, task building included);
      * ``per_item["exact_match"]`` (0.0/1.0 floats), ``per_item["response_nll"]`` (floats, nats per
        token), ``per_item["generated"]`` (the raw generations, cut before ``"\\n"``, not stripped),
        each a list in the order of ``pairs``, from lm-eval's logged samples matched by ``id``.

      ``out_dir/pair_eval.json`` gets lm-eval's full results (JSON-safe, per-sample records left
      out), these metrics, the per-item values with ids, the number of truncated loglikelihood
      requests (prompt + response over ``max_len + 1`` tokens: prompt cut from the left) and the
      task file info.

    Raises:
      ValueError: for bad pairs (see :func:`build_pair_tasks`) or a tokenizer :class:`JaxLM` rejects.
      RuntimeError: if lm-eval's logged samples do not correspond one-to-one to the pairs, or its
        requests differ from ``(prompt, …)`` / ``(prompt, response)``.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    tasks, info = build_pair_tasks(pairs, out_dir, max_gen_toks=max_gen_toks)
    rows = _check_pairs(pairs)
    ids = [r["id"] for r in rows]
    lm = JaxLM(model, tokenizer, batch_size=batch_size, max_gen_toks=max_gen_toks)
    with _no_multiprocessing():
        res = run_local_tasks(lm, tasks, seed)
    samples = res.get("samples", {})
    gen = _by_id(samples.get(GEN_TASK, []), GEN_TASK, ids, GEN_FILTER)
    ll = _by_id(samples.get(LL_TASK, []), LL_TASK, ids, "none")

    em, nll, generated = _per_item(rows, gen, ll, lm)
    gen_res, ll_res = res["results"][GEN_TASK], res["results"][LL_TASK]
    n = len(rows)
    metrics = {
        "exact_match": float(gen_res[f"exact_match,{GEN_FILTER}"]),
        "exact_match_stderr": _stderr(gen_res.get(f"exact_match_stderr,{GEN_FILTER}")),
        "response_nll": sum(nll) / n,
        "response_greedy": float(ll_res["acc,none"]),
        "items": n,
        "eval_s": time.perf_counter() - t0,
    }
    _log_pair_eval(metrics, lm)
    out = {"metrics": metrics, "per_item": {"exact_match": em, "response_nll": nll, "generated": generated}}
    _write_results(out_dir, res, metrics, rows, out["per_item"], int(lm.truncated_requests), info)
    return out


def _write_results(out_dir: Path, res: dict, metrics: dict, rows, per_item: dict, truncated: int, info) -> None:
    """Write ``out_dir/pair_eval.json``: lm-eval's results (samples left out), the metrics, the
    per-item values with ids, the truncated requests and the task file info."""
    payload = _jsonable({k: v for k, v in res.items() if k != "samples"})
    payload["metrics"] = _jsonable(metrics)
    payload["items"] = [
        {"id": r["id"], "response": r["response"], "generated": g_, "exact_match": e, "response_nll": x}
        for r, g_, e, x in zip(rows, per_item["generated"], per_item["exact_match"], per_item["response_nll"])
    ]
    payload["truncated_requests"] = truncated
    payload["task_files"] = info
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out_dir / RESULTS_FILE, _jsonable(payload), default=None, ensure_ascii=False)


def _per_item(rows: list[dict], gen: dict, ll: dict, lm) -> tuple[list[float], list[float], list[str]]:
    """Per pair, in order: exact match (0.0/1.0), response NLL (nats per token) and the generation.
    ``RuntimeError`` when lm-eval's requests are not the pair's (prompt, response) verbatim."""
    em, nll, generated = [], [], []
    for r in rows:
        g, s = gen[r["id"]], ll[r["id"]]
        ((ctx, _),) = g["arguments"]
        ((l_ctx, l_cont),) = s["arguments"]
        if ctx != r["prompt"] or (l_ctx, l_cont) != (r["prompt"], r["response"]):
            raise RuntimeError(
                f"lm-eval's requests for pair {r['id']!r} are not (prompt, response) verbatim: "
                f"generate {ctx!r}, loglikelihood {(l_ctx, l_cont)!r}"
            )
        em.append(float(g["exact_match"]))
        generated.append(str(g["resps"][0][0]))
        n_tok = len(lm.split_pair(r["prompt"], r["response"])[1])
        nll.append(-float(s["perplexity"]) / n_tok)  # lm-eval logs the item's total log-likelihood here
    return em, nll, generated


def _log_pair_eval(metrics: dict, lm) -> None:
    """Log the pair eval's metrics, and its truncated requests (a warning at ≥ 5 % of the items)."""
    n = metrics["items"]
    if lm.truncated_requests:  # a warning when it changes the picture (≥ 5 % of the items), else a note
        (log.warning if lm.truncated_requests >= 0.05 * n else log.info)(
            "pair eval: %d of %d responses scored with their prompt cut from the left (%d-token window)",
            lm.truncated_requests,
            n,
            lm.max_length + 1,
        )
    log.info(
        "pair eval: %d pairs, exact_match %.3f, response_nll %.4f nats/token, greedy %.3f; %.1f s",
        n,
        metrics["exact_match"],
        metrics["response_nll"],
        metrics["response_greedy"],
        metrics["eval_s"],
    )
