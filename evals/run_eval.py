"""Evaluate one trained model with lm-eval-harness on the generated held-out tasks, offline.

``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` are set (if unset) before ``datasets``/``lm_eval`` are
imported here: the tasks read local JSONL files and must never reach for the hub. If ``datasets`` was
imported earlier by the caller, those settings had to be made by the caller.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from configs.schema import EvalConfig  # noqa: E402
from evals.heldout_tasks import MC_TASK, PPL_TASK, build_heldout_tasks  # noqa: E402
from evals.lm_adapter import JaxLM  # noqa: E402

FLAT_METRICS = {
    PPL_TASK: ("word_perplexity", "byte_perplexity", "bits_per_byte"),
    MC_TASK: ("acc", "acc_norm"),
}


def _jsonable(x):
    """Recursively keep what JSON can hold; other objects become their ``repr``; NaN/Inf → None."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, (str, int, bool)):
        return x
    if hasattr(x, "item") and getattr(x, "ndim", None) == 0:  # numpy / jax scalars
        return _jsonable(x.item())
    if callable(x):
        return getattr(x, "__name__", repr(x))
    return repr(x)


def evaluate_lm(
    model,
    tokenizer,
    heldout_docs: list[dict],
    out_dir: str | Path,
    eval_cfg: EvalConfig,
    seed: int = 0,
    name: str | None = None,
) -> dict:
    """Run ``heldout_ppl`` and ``heldout_nextline`` (lm-eval, zero-shot) on ``model``.

    Args:
      model: NNX LM, ``model(ids_BL int32) -> logits_BLV float32``, with ``max_len``.
      tokenizer: the run's byte-level BPE ``tokenizers.Tokenizer`` (with ``<|endoftext|>``).
      heldout_docs: ``[{"title", "text"}]``, the held-out (test) documents.
      out_dir: folder for the generated task files (``out_dir/tasks/``) and the results JSON.
      eval_cfg: sizes of the tasks and the forward batch size.
      seed: task generation and lm-eval seeds.
      name: if given, the full lm-eval results (JSON-safe: non-serialisable values become strings,
        non-finite floats ``null``) are written to ``out_dir/<name>.json``.

    Returns:
      Flat dict: ``heldout_ppl/word_perplexity``, ``heldout_ppl/byte_perplexity`` (per UTF-8 byte),
      ``heldout_ppl/bits_per_byte``, ``heldout_nextline/acc``, ``heldout_nextline/acc_norm`` (in
      [0, 1]), ``heldout_ppl/passages``, ``heldout_nextline/questions`` and ``eval_s`` (wall seconds
      of task building + evaluation).

    Raises:
      ValueError: from :func:`build_heldout_tasks` when the documents are too short.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    tasks, info = build_heldout_tasks(
        heldout_docs,
        out_dir / "tasks",
        ppl_docs=eval_cfg.ppl_docs,
        ppl_chars=eval_cfg.ppl_chars,
        mc_questions=eval_cfg.mc_questions,
        mc_context_lines=eval_cfg.mc_context_lines,
        seed=seed,
    )
    lm = JaxLM(model, tokenizer, batch_size=eval_cfg.batch_size)
    res = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=TaskManager(include_defaults=False),
        num_fewshot=0,
        bootstrap_iters=0,
        log_samples=False,
        limit=None,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    eval_s = time.perf_counter() - t0
    flat: dict = {}
    for task, metrics in FLAT_METRICS.items():
        for m in metrics:
            flat[f"{task}/{m}"] = float(res["results"][task][f"{m},none"])
    flat["heldout_ppl/passages"] = info["ppl_passages"]
    flat["heldout_nextline/questions"] = info["mc_questions"]
    flat["eval_s"] = eval_s
    if name:
        out_dir.mkdir(parents=True, exist_ok=True)
        payload = _jsonable({k: v for k, v in res.items() if k != "samples"})
        payload["flat"] = flat
        payload["task_files"] = info
        tmp = out_dir / f"{name}.json.tmp"
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(out_dir / f"{name}.json")
    return flat
