"""Evaluate one trained model with lm-eval-harness on the generated held-out tasks, offline.

``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` are set (if unset) before ``datasets``/``lm_eval`` are
imported here: the tasks read local JSONL files and must never reach for the hub. If ``datasets`` was
imported earlier by the caller, those settings had to be made by the caller.

Standard errors come from lm-eval's own machinery, and nothing here forks: a ``multiprocessing``
pool forked from a process with JAX and Prefect threads running can deadlock. ``acc`` is
mean-aggregated, for which ``lm_eval.api.metrics.stderr_for_metric`` uses the closed form
``mean_stderr``; the perplexity aggregations (``weighted_perplexity``, ``bits_per_byte``) get no
stderr from lm-eval, so :func:`evaluate_lm` bootstraps them over the passages with
``lm_eval.api.metrics.bootstrap_stderr`` itself. Both run with ``DISABLE_MULTIPROC=1`` set (for the
duration of the call only), which makes lm-eval's bootstrap run in-process instead of in a
``multiprocessing.Pool``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.api import metrics as lm_metrics  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from configs.eval import EvalConfig  # noqa: E402
from evals.heldout_tasks import MC_TASK, PPL_TASK, build_heldout_tasks  # noqa: E402
from evals.lm_adapter import JaxLM  # noqa: E402
from run import atomic  # noqa: E402

FLAT_METRICS = {
    PPL_TASK: ("word_perplexity", "byte_perplexity", "bits_per_byte"),
    MC_TASK: ("acc",),
}
# lm-eval aggregation of each perplexity metric, for bootstrapping its stderr over passages.
PPL_AGGREGATIONS = {
    "word_perplexity": lm_metrics.weighted_perplexity,
    "byte_perplexity": lm_metrics.weighted_perplexity,
    "bits_per_byte": lm_metrics.bits_per_byte,
}
BOOTSTRAP_ITERS = 1000  # resamples for the perplexity stderrs (in-process; ~0.1 s for 16 passages)

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _no_multiprocessing():
    """Make lm-eval's bootstrap run in-process (``DISABLE_MULTIPROC``) for the duration."""
    old = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = old


def _stderr(value) -> float | None:
    """lm-eval's ``<metric>_stderr`` value as a float; ``None`` for its ``"N/A"`` or a non-finite one."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _say(msg: str, *args, warning: bool = False) -> None:
    """Log to this module's logger (the Prefect task that calls the evaluation logs its outcome)."""
    (log.warning if warning else log.info)(msg, *args)


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


def run_local_tasks(lm: JaxLM, tasks: list[dict], seed: int, verbose: bool = False) -> dict:
    """``lm_eval.simple_evaluate`` on our local task configs, zero-shot, every lm-eval seed set to
    ``seed``, per-item samples logged, stderrs computed (``BOOTSTRAP_ITERS`` > 0: the closed form for
    means). Call it inside :func:`_no_multiprocessing`. Returns lm-eval's results dict. lm-eval's own
    INFO lines ("bootstrapping for stddev", task building) are held back unless ``verbose``
    (``eval.verbose``); its warnings always show."""
    with _lm_eval_quiet(not verbose):
        return _simple_evaluate(lm, tasks, seed)


@contextlib.contextmanager
def _lm_eval_quiet(quiet: bool):
    """lm-eval's INFO lines, its print()s ("bootstrapping for stddev: …"; the evaluation tasks run
    with Prefect's log_prints off) and the datasets library's progress bars (lm-eval loading the
    task files) held back while ``quiet``."""
    import datasets

    logger = logging.getLogger("lm_eval")
    level, bars = logger.level, datasets.is_progress_bar_enabled()
    if quiet:
        logger.setLevel(logging.WARNING)
        datasets.disable_progress_bars()
    try:
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
            yield
    finally:
        logger.setLevel(level)
        if quiet and bars:
            datasets.enable_progress_bars()


def _simple_evaluate(lm: JaxLM, tasks: list[dict], seed: int) -> dict:
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=TaskManager(include_defaults=False),
        num_fewshot=0,
        bootstrap_iters=BOOTSTRAP_ITERS,
        log_samples=True,
        limit=None,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )


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
        non-finite floats ``null``; per-sample records left out) are written to
        ``out_dir/<name>.json``.

    Returns:
      Flat dict:

      * ``heldout_ppl/word_perplexity``, ``heldout_ppl/byte_perplexity`` (per UTF-8 byte),
        ``heldout_ppl/bits_per_byte``, each with ``<key>_stderr`` (bootstrap over the passages,
        lm-eval's ``bootstrap_stderr``; ``None`` with fewer than 2 passages), and
        ``heldout_ppl/passages``;
      * ``heldout_nextline/acc`` (in [0, 1]), ``heldout_nextline/acc_stderr`` (lm-eval's closed-form
        ``mean_stderr``; ``None`` with fewer than 2 questions), ``heldout_nextline/chance`` (the
        expected accuracy of a uniform guess, 0.25) and ``heldout_nextline/questions``;
      * ``truncated_requests`` (int): loglikelihood requests whose context + continuation exceeded
        ``max_len + 1`` tokens, so that the context was cut from the left (logged as a warning
        when non-zero);
      * ``eval_s``: wall seconds of task building + evaluation.

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
    lm = JaxLM(model, tokenizer, batch_size=eval_cfg.batch_size, progress=eval_cfg.verbose)
    with _no_multiprocessing(), _lm_eval_quiet(not eval_cfg.verbose):
        res = run_local_tasks(lm, tasks, seed, verbose=eval_cfg.verbose)
        flat: dict = {}
        for task, metrics in FLAT_METRICS.items():
            for m in metrics:
                flat[f"{task}/{m}"] = float(res["results"][task][f"{m},none"])
                flat[f"{task}/{m}_stderr"] = _stderr(res["results"][task].get(f"{m}_stderr,none"))
        samples = res.get("samples", {}).get(PPL_TASK, [])
        for m, agg in PPL_AGGREGATIONS.items():
            items = [tuple(s[m]) for s in samples]
            if len(items) > 1:
                flat[f"{PPL_TASK}/{m}_stderr"] = _stderr(lm_metrics.bootstrap_stderr(agg, items, iters=BOOTSTRAP_ITERS))
    flat[f"{MC_TASK}/chance"] = info["mc_chance"]
    flat["heldout_ppl/passages"] = info["ppl_passages"]
    flat["heldout_nextline/questions"] = info["mc_questions"]
    flat["truncated_requests"] = int(lm.truncated_requests)
    eval_s = time.perf_counter() - t0
    flat["eval_s"] = eval_s
    if lm.truncated_requests:
        _say(
            "lm-eval: %d loglikelihood requests exceeded the %d-token window; their contexts were cut from the left",
            lm.truncated_requests,
            lm.max_length + 1,
            warning=True,
        )
    _say(
        "lm-eval: %s acc %.3f ± %s (chance %.2f), %s bits/byte %.4f; %d truncated requests; %.1f s",
        MC_TASK,
        flat[f"{MC_TASK}/acc"],
        _fmt(flat[f"{MC_TASK}/acc_stderr"]),
        flat[f"{MC_TASK}/chance"],
        PPL_TASK,
        flat[f"{PPL_TASK}/bits_per_byte"],
        flat["truncated_requests"],
        eval_s,
    )
    if name:
        out_dir.mkdir(parents=True, exist_ok=True)
        payload = _jsonable({k: v for k, v in res.items() if k != "samples"})
        payload["flat"] = flat
        payload[f"{MC_TASK}_by_kind"] = _wins_by_kind(res.get("samples", {}).get(MC_TASK, []))
        payload["task_files"] = info
        atomic.write_json(out_dir / f"{name}.json", payload, default=None)
    return flat


def _wins_by_kind(samples: list[dict]) -> dict:
    """Per distractor kind: how often the true context gave the answer a higher log-likelihood
    (``{kind: {"wins": fraction, "n": questions}}``), from lm-eval's per-question samples."""
    wins: dict[str, list[bool]] = {}
    for s in samples:
        lls = [float(r[0]) for r in s["filtered_resps"]]
        kinds, label = s["doc"]["kinds"], int(s["doc"]["label"])
        for k, ll in zip(kinds, lls):
            if k != "true":
                wins.setdefault(k, []).append(lls[label] > ll)
    return {k: {"wins": sum(v) / len(v), "n": len(v)} for k, v in sorted(wins.items())}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
