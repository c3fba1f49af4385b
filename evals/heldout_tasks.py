"""Local lm-eval tasks generated from held-out documents (the test plays).

* ``heldout_ppl`` (``loglikelihood_rolling``): up to ``ppl_docs`` passages of about ``ppl_chars``
  characters, cut at line boundaries, spread round-robin over the documents; metrics
  ``word_perplexity``, ``byte_perplexity``, ``bits_per_byte``.
* ``heldout_nextline`` (4-way ``multiple_choice``): "which line comes next". The context is
  ``mc_context_lines`` consecutive non-empty lines (blank lines skipped, lines otherwise verbatim,
  joined by ``"\\n"``); the choices are the true next non-empty line and 3 distractors: real lines of
  the same document, textually different (after ``strip``) from the answer, from each other and from
  the context, preferring lengths close to the answer's. The answer's position is drawn from the
  seed. Metrics ``acc`` and ``acc_norm`` (lm-eval's length-normalised accuracy). The request lm-eval
  scores is ``(context, "\\n" + choice)``.

Everything is a deterministic function of ``(docs, sizes, seed)``. The JSONL files are written to
``out_dir`` and the task configs refer to them by absolute path, so they can be handed straight to
``lm_eval.simple_evaluate(tasks=[ppl_cfg, mc_cfg], task_manager=TaskManager(include_defaults=False))``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PPL_TASK = "heldout_ppl"
MC_TASK = "heldout_nextline"
N_CHOICES = 4
MIN_ANSWER_CHARS = 8  # answers like "Exit." recur all over a play and are guesswork
DISTRACTOR_POOL = 24  # random candidates drawn per question; the 3 closest in length are kept


def _lines(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]


def make_passages(docs: list[dict], n_passages: int, n_chars: int, seed: int) -> list[dict]:
    """Up to ``n_passages`` passages ``{"title", "text", "start_line"}`` of ≥ ``n_chars`` characters.

    Each document is cut into consecutive passages at line boundaries (the last, shorter piece of a
    document is kept only if it is at least half of ``n_chars``); passages are then taken
    round-robin over the documents, in a seeded random order within each document, and returned in
    document order. Leading/trailing blank lines of a passage are dropped.
    """
    rng = random.Random(f"ppl-{seed}")
    per_doc: list[list[dict]] = []
    for doc in docs:
        chunks, cur, start = [], [], 0
        for i, ln in enumerate(_lines(doc["text"])):
            if not cur and not ln.strip():
                start = i + 1
                continue
            cur.append(ln)
            if len("\n".join(cur)) >= n_chars:
                chunks.append({"title": doc["title"], "text": "\n".join(cur).strip("\n"), "start_line": start})
                cur, start = [], i + 1
        tail = "\n".join(cur).strip("\n")
        if len(tail) >= n_chars // 2:
            chunks.append({"title": doc["title"], "text": tail, "start_line": start})
        rng.shuffle(chunks)
        per_doc.append(chunks)
    picked: list[dict] = []
    depth = 0
    while len(picked) < n_passages and any(depth < len(c) for c in per_doc):
        for chunks in per_doc:
            if depth < len(chunks) and len(picked) < n_passages:
                picked.append(chunks[depth])
        depth += 1
    order = {d["title"]: i for i, d in enumerate(docs)}
    return sorted(picked, key=lambda p: (order[p["title"]], p["start_line"]))


def make_nextline_questions(
    docs: list[dict], n_questions: int, context_lines: int, seed: int
) -> list[dict]:
    """``n_questions`` (fewer if the documents are too short) next-line questions.

    Each is ``{"title", "question", "choices": [4 str], "label": int, "line_index"}``, where
    ``question`` is the context (lines joined by ``"\\n"``), ``choices[label]`` the true next line and
    ``line_index`` the answer's index among the document's non-empty lines. Questions are split as
    evenly as possible over the documents that can host one.
    """
    rng = random.Random(f"mc-{seed}")
    plays = []
    for doc in docs:
        lines = [ln for ln in _lines(doc["text"]) if ln.strip()]
        distinct = {ln.strip() for ln in lines}
        anchors = [
            i
            for i in range(context_lines, len(lines))
            if len(lines[i].strip()) >= MIN_ANSWER_CHARS
        ]
        if anchors and len(distinct) >= N_CHOICES + context_lines:
            plays.append((doc["title"], lines, anchors))
    if not plays:
        return []
    quotas = [n_questions // len(plays) + (k < n_questions % len(plays)) for k in range(len(plays))]
    # A short play may not fill its quota; hand the rest to the others.
    caps = [len(a) for _, _, a in plays]
    spare = sum(max(0, q - c) for q, c in zip(quotas, caps))
    quotas = [min(q, c) for q, c in zip(quotas, caps)]
    for k in range(len(plays)):
        extra = min(spare, caps[k] - quotas[k])
        quotas[k] += extra
        spare -= extra

    out = []
    for (title, lines, anchors), quota in zip(plays, quotas):
        for i in sorted(rng.sample(anchors, quota)):
            answer = lines[i]
            context = lines[i - context_lines : i]
            banned = {answer.strip()} | {c.strip() for c in context}
            pool: list[str] = []
            seen = set(banned)
            for _ in range(20 * DISTRACTOR_POOL):  # bounded: a play of few distinct lines ends early
                cand = lines[rng.randrange(len(lines))]
                if cand.strip() not in seen:
                    pool.append(cand)
                    seen.add(cand.strip())
                if len(pool) >= DISTRACTOR_POOL:
                    break
            if len(pool) < N_CHOICES - 1:
                continue
            pool.sort(key=lambda c: abs(len(c.strip()) - len(answer.strip())))
            choices = pool[: N_CHOICES - 1]
            label = rng.randrange(N_CHOICES)
            choices.insert(label, answer)
            out.append(
                {"title": title, "question": "\n".join(context), "choices": choices, "label": label, "line_index": i}
            )
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)


def _dataset_kwargs(path: Path, out_dir: Path) -> dict:
    # A cache folder of our own: the `json` builder keys its Arrow cache on file metadata, and the
    # shared ~/.cache must not serve another run's questions.
    return {"data_files": {"test": str(path)}, "cache_dir": str(out_dir / "hf_cache")}


def build_heldout_tasks(
    docs: list[dict],
    out_dir: str | Path,
    ppl_docs: int = 16,
    ppl_chars: int = 2000,
    mc_questions: int = 200,
    mc_context_lines: int = 4,
    seed: int = 0,
) -> tuple[list[dict], dict]:
    """Write ``heldout_ppl.jsonl`` / ``heldout_nextline.jsonl`` into ``out_dir``; return task configs.

    Args:
      docs: held-out documents ``{"title": str, "text": str}`` (lines separated by ``"\\n"``).
      out_dir: folder for the JSONL files (created; existing files are replaced atomically).

    Returns:
      ``(task_configs, info)``: a list of lm-eval task config dicts (absolute data paths; pass them
      as ``tasks=``), and ``info`` with the file paths and the number of passages and questions.

    Raises:
      ValueError: if ``docs`` is empty, or no passage or no question can be made from them.
    """
    if not docs:
        raise ValueError("no held-out documents given")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    passages = make_passages(docs, ppl_docs, ppl_chars, seed)
    questions = make_nextline_questions(docs, mc_questions, mc_context_lines, seed)
    if not passages:
        raise ValueError(f"held-out documents too short for one {ppl_chars}-character passage")
    if not questions:
        raise ValueError("held-out documents too short for a next-line question")
    ppl_path, mc_path = out_dir / f"{PPL_TASK}.jsonl", out_dir / f"{MC_TASK}.jsonl"
    _write_jsonl(ppl_path, passages)
    _write_jsonl(mc_path, questions)

    ppl_cfg = {
        "task": PPL_TASK,
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": _dataset_kwargs(ppl_path, out_dir),
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "text",  # a field name: used verbatim, no Jinja rendering
        "metric_list": [
            {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
            {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
        ],
        "metadata": {"version": 1.0, "seed": seed, "ppl_chars": ppl_chars},
    }
    mc_cfg = {
        "task": MC_TASK,
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": _dataset_kwargs(mc_path, out_dir),
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "question",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "target_delimiter": "\n",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0, "seed": seed, "context_lines": mc_context_lines},
    }
    info = {
        "ppl_path": str(ppl_path),
        "mc_path": str(mc_path),
        "ppl_passages": len(passages),
        "mc_questions": len(questions),
    }
    return [ppl_cfg, mc_cfg], info
