"""Local lm-eval tasks generated from held-out documents (the test plays).

* ``heldout_ppl`` (``loglikelihood_rolling``): up to ``ppl_docs`` passages of about ``ppl_chars``
  characters, cut at line boundaries, spread round-robin over the documents; metrics
  ``word_perplexity``, ``byte_perplexity``, ``bits_per_byte``.
* ``heldout_nextline`` (4-way ``multiple_choice`` with *multiple inputs*, like lm-eval's
  Winogrande): "which passage does this line come next after". A question is one answer line
  (a non-empty line of at least ``MIN_ANSWER_CHARS`` characters) and 4 candidate contexts of
  ``mc_context_lines`` consecutive non-empty lines (blank lines skipped, lines otherwise verbatim,
  joined by ``"\\n"``): the lines truly before it, and 3 graded distractors (kinds, hardest first):

  - ``near``: the window ending 2·``mc_context_lines`` to 2·``mc_context_lines`` + 24 lines before
    the answer (same scene, same speakers, but not adjacent);
  - ``far``: a window of the same play at least ``FAR_LINES`` lines away;
  - ``other_doc``: a window of another held-out document (a second ``far`` window when there is
    only one document).

  lm-eval scores ``log p("\\n" + answer | context_i)`` for each context and picks the argmax
  (metric ``acc``, chance ``1/4``). The continuation is *the same string for every choice*, so the
  answer's own prior probability cancels: only what the context tells the model about the line
  counts. (The earlier design, 4 candidate *lines* after one context, compared the lines' priors:
  a frequent-word line beat the true one whatever the context, and both trained default models
  scored at chance.) Length normalisation is meaningless here (the choices are the contexts), so
  there is no ``acc_norm``. Distractor contexts differ from the true one and from each other and
  never contain the answer line; the true context's position is drawn from the seed.

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
NEAR_SPAN = 24  # the near window ends 2·context_lines .. 2·context_lines + NEAR_SPAN lines before the answer
FAR_LINES = 50  # a far window ends at least this many lines away from the answer
DISTRACTOR_KINDS = ("near", "far", "other_doc")
_TRIES = 64  # random draws per distractor before giving up on that anchor


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


def _window(lines: list[str], end: int, n: int) -> str:
    return "\n".join(lines[end - n : end])


def make_nextline_questions(docs: list[dict], n_questions: int, context_lines: int, seed: int) -> list[dict]:
    """``n_questions`` (fewer if the documents are too short) next-line questions.

    Each is ``{"title", "answer", "contexts": [4 str], "kinds": [4 str], "label": int,
    "line_index"}``: ``contexts[label]`` (kind ``"true"``) is the ``context_lines`` non-empty lines
    before ``answer`` (joined by ``"\\n"``), the other three are the distractor windows of kinds
    ``near``, ``far``, ``other_doc`` (see the module docstring), and ``line_index`` is the answer's
    index among its document's non-empty lines. Questions are split as evenly as possible over the
    documents that can host one.
    """
    rng = random.Random(f"mc-{seed}")
    n = context_lines
    plays = []
    for doc in docs:
        lines = [ln for ln in _lines(doc["text"]) if ln.strip()]
        # Room for the near window before the answer: it ends ≥ 2n lines before, and is n long.
        anchors = [i for i in range(3 * n, len(lines)) if len(lines[i].strip()) >= MIN_ANSWER_CHARS]
        if anchors and len(lines) > 4 * n:
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
    for p, ((title, lines, anchors), quota) in enumerate(zip(plays, quotas)):
        others = [q for q in range(len(plays)) if q != p]
        for i in sorted(rng.sample(anchors, quota)):
            answer = lines[i]
            true_ctx = _window(lines, i, n)
            taken = {true_ctx}

            def ok(ctx: str) -> bool:
                return ctx not in taken and answer.strip() not in {ln.strip() for ln in ctx.split("\n")}

            # Far windows end ≥ FAR_LINES lines from the answer; a play too short for that takes any
            # window disjoint from the true context and the answer.
            far_ok = i - FAR_LINES >= n or i + FAR_LINES <= len(lines)

            def draw(kind: str) -> str | None:
                for _ in range(_TRIES):
                    if kind == "near":
                        ctx = _window(lines, i - rng.randint(2 * n, min(2 * n + NEAR_SPAN, i - n)), n)
                    elif kind == "other_doc" and others:
                        o_lines = plays[others[rng.randrange(len(others))]][1]
                        ctx = _window(o_lines, rng.randint(n, len(o_lines)), n)
                    else:  # far, and other_doc when there is a single document
                        end = rng.randint(n, len(lines))
                        if (abs(end - i) < FAR_LINES) if far_ok else (i - n < end < i + 1 + n):
                            continue
                        ctx = _window(lines, end, n)
                    if ok(ctx):
                        return ctx
                return None

            contexts, kinds = [], []
            for kind in DISTRACTOR_KINDS:
                ctx = draw(kind)
                if ctx is None:
                    break
                taken.add(ctx)
                contexts.append(ctx)
                kinds.append(kind if kind != "other_doc" or others else "far")
            if len(contexts) < N_CHOICES - 1:
                continue
            label = rng.randrange(N_CHOICES)
            contexts.insert(label, true_ctx)
            kinds.insert(label, "true")
            out.append(
                {
                    "title": title,
                    "answer": answer,
                    "contexts": contexts,
                    "kinds": kinds,
                    "label": label,
                    "line_index": i,
                }
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
      as ``tasks=``), and ``info`` with the file paths, the number of passages and questions and
      ``mc_chance``, the expected ``heldout_nextline`` accuracy of a uniform random guess.

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
        "num_fewshot": 0,  # zero-shot by the task itself (lm-eval then does not warn of an override)
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
        "num_fewshot": 0,
        # Multiple inputs (lm-eval's Winogrande mode): doc_to_text is the gold index (an int), the
        # choices are the contexts, the target the one continuation scored after each of them.
        "doc_to_text": "label",
        "doc_to_choice": "contexts",
        "doc_to_target": "answer",
        "target_delimiter": "\n",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 2.0, "seed": seed, "context_lines": mc_context_lines},
    }
    info = {
        "ppl_path": str(ppl_path),
        "mc_path": str(mc_path),
        "ppl_passages": len(passages),
        "mc_questions": len(questions),
        "mc_chance": sum(1.0 / len(q["contexts"]) for q in questions) / len(questions),
    }
    return [ppl_cfg, mc_cfg], info
