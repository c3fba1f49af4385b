"""Fine-tuning data: the task's train and test items, built once per run directory.

Text tasks are prompt/response pairs ``{"id", "prompt", "response"}`` (the response is the text
that follows the prompt verbatim; the loss and the evaluation look at it alone):

* ``speakers`` (the embedded default): *name the character who speaks a line*. Built from the plays
  of ``data.finetune_docs``, held out of pretraining and of its evaluation. A prompt shows the play's
  title, the ``finetune.speaker_context`` speeches before (each its speaker and the end of its last
  line) and the first ``finetune.speaker_lines`` lines of a speech; the response is its speaker's
  name::

      As You Like It
      ORLANDO: Come, come, elder brother, you are too young in this.
      OLIVER: Wilt thou lay hands on me, villain?
      ?: I am no villain: I am the youngest son of Sir Rowland de / Bois: he was my father…
      Speaker: ORLANDO

  Why this task: in a play the name comes *before* the speech, so a language model pretrained on
  plays predicts names from what precedes them, never the speaker of a line it has just read, and
  never in this format: it cannot do the task before fine-tuning (it scores 0). Fine-tuned, it has
  to read the context: who spoke two speeches ago (dialogue alternates), who is addressed, the
  play's cast and style, which is what a better pretrained model should do better. The items of
  each play are split at random into train and test (``finetune.test_fraction``, seeded), so the
  test speeches are unseen while the cast is known. Two rules without a model are the baselines:
  the majority speaker of the play (learnt from the train items) and the speaker two speeches back.
* ``jsonl``: the user's pairs (``finetune.paths``: a train file, optionally a test file; fields
  ``finetune.prompt_field`` and ``finetune.response_field``).
* ``hf``: a Hugging Face dataset with the same field mapping (``finetune.hf_name``; needs the hub,
  or a local dataset folder saved with ``save_to_disk``).

Image task ``rotation`` (the embedded default): which of 0°, 90°, 180° or 270° an image was turned
by, a 4-way label set the pretraining never used, learnt by a new head on the pretrained backbone.
The validation images (never trained on) × 4 rotations are the train items, the test images × 4 the
test items.

Rows (text): ``ids int32[N, S+1]`` and ``mask float32[N, S+1]`` (1 where the token is a target:
a response token or the EOT that closes the response, so a tuned model learns to stop; the loss of
predicting token t counts iff ``mask[t]``), padded with the EOT id (mask 0), or packed
(``finetune.packing``: several pairs per row, each closed by its EOT target, the mask carried
through).

Files written by :func:`prepare_finetune_data` into ``RUN/finetune/data/`` (through a temp folder
renamed into place): ``manifest.json``, ``train.npz``, ``test.npz`` (rows), and for text
``pairs_train.jsonl`` / ``pairs_test.jsonl``. No JAX, no Prefect here.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from configs.data import DataConfig
from configs.finetune import FinetuneConfig
from data.sources import EOT
from run import atomic
from run.layout import PAIRS_FILE

Pair = dict[str, str]
MIN_TRAIN_ITEMS, MIN_TEST_ITEMS = 8, 4
ROTATIONS = (0, 90, 180, 270)

# A speech heading: a line holding only a name (1-4 capitalised words), either ending with "." (the
# Gutenberg texts' "ORLANDO." / "Ber.") or in capitals ("LYSANDER"); act and scene headings excluded.
_HEADING = re.compile(r"^([A-Z][A-Za-z'\-]*\.?(?: [A-Za-z][A-Za-z'\-]*\.?){0,3})$")
_NOT_SPEAKER = re.compile(r"^(ACT|SCENE|EPILOGUE\.?$|PROLOGUE\.?$|Enter|Exit|Exeunt|FINIS|THE END)", re.I)


def _speaker(line: str) -> str | None:
    line = line.strip()
    if not _HEADING.match(line) or _NOT_SPEAKER.match(line):
        return None
    if not (line.endswith(".") or line.replace("'", "").replace("-", "").replace(" ", "").isupper()):
        return None
    return line.rstrip(".").strip() or None


def play_speeches(text: str) -> list[dict | None]:
    """The blocks of a play in order: ``{"speaker", "lines"}`` for a speech (a heading line then at
    least one line of text), ``None`` for anything else (stage directions, scene headings)."""
    out: list[dict | None] = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [ln.strip() for ln in block.strip("\n").split("\n") if ln.strip()]
        name = _speaker(lines[0]) if len(lines) >= 2 else None
        spoken = [ln for ln in lines[1:] if not (ln.startswith("[") and ln.endswith("]"))] if name else []
        out.append({"speaker": name, "lines": spoken} if name and spoken else None)
    return out


CONTEXT_CHARS, SPEECH_CHARS = 60, 120  # prompt pieces are clipped at a word to keep rows short


def _clip(text: str, limit: int, left: bool = False) -> str:
    """``text`` cut to at most about ``limit`` characters at a space, marked with "…" (from the left:
    the end is kept)."""
    if len(text) <= limit:
        return text
    if left:
        cut = text[-limit:]
        return "…" + cut[cut.find(" ") + 1 :] if " " in cut else "…" + cut
    cut = text[:limit]
    return (cut[: cut.rfind(" ")] if " " in cut else cut) + "…"


def speaker_pairs(docs: Sequence[dict], context: int = 2, speech_lines: int = 2) -> list[Pair]:
    """The ``speakers`` task's pairs from plays ``[{"title", "text"}]``, in document order.

    Each speech gives one pair (id ``"<title>#<k>"``, plus ``title``, ``speaker`` and ``two_back``,
    the speaker two speeches before or None): prompt = title; each of the up to ``context`` speeches
    right before it (a run of speeches: a stage direction or scene heading ends it) as its speaker
    and the end of its last line (at most ``CONTEXT_CHARS`` characters); the first ``speech_lines``
    lines of the speech (at most ``SPEECH_CHARS`` characters; lines joined by " / "); then
    ``"Speaker:"``. Response = ``" <NAME>\\n"``.
    """
    pairs: list[Pair] = []
    for doc in docs:
        blocks = play_speeches(doc["text"])
        k = 0
        for i, cur in enumerate(blocks):
            if cur is None:
                continue
            before: list[dict] = []
            j = i - 1
            while j >= 0 and blocks[j] is not None and len(before) < max(context, 2):
                before.insert(0, blocks[j])
                j -= 1
            head = [doc["title"]]
            for prev in before[len(before) - context :] if context else []:
                head.append(f"{prev['speaker']}: {_clip(prev['lines'][-1], CONTEXT_CHARS, left=True)}")
            head.append(f"?: {_clip(' / '.join(cur['lines'][:speech_lines]), SPEECH_CHARS)}")
            pairs.append(
                {
                    "id": f"{doc['title']}#{k}",
                    "prompt": "\n".join(head) + "\nSpeaker:",
                    "response": f" {cur['speaker']}\n",
                    "title": doc["title"],
                    "speaker": cur["speaker"],
                    "two_back": before[-2]["speaker"] if len(before) >= 2 else None,
                }
            )
            k += 1
    return pairs


def _check_pairs(
    rows: list[dict], prompt_field: str, response_field: str, where: str, lines: Sequence[int] | None = None
) -> list[Pair]:
    """``rows`` as pairs (ids: ``str(row["id"])``, or the row's position); ``lines``: each row's line
    number in the file, for the messages. Raises ``ValueError`` naming the item (its line) and the field,
    or both lines of an id given twice (ids identify pairs in evaluation: 1 and "1" are one id)."""
    if not rows:
        raise ValueError(f"{where} holds no pairs; give a file with one JSON object per line")
    pairs = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        for field, name in ((prompt_field, "finetune.prompt_field"), (response_field, "finetune.response_field")):
            if field not in row:
                raise ValueError(
                    f"{where}: item {i + 1} has no field {field!r} ({name}); it has "
                    f"{sorted(row)[:8]}; set {name} to the right field"
                )
            if not isinstance(row[field], str):
                raise ValueError(f"{where}: item {i + 1} field {field!r} is {type(row[field]).__name__}, not text")
        if not row[response_field].strip():
            raise ValueError(f"{where}: item {i + 1} has an empty response; remove it")
        pid = str(row.get("id", i))
        if pid in seen:
            at = (lambda k: f"line {lines[k]}") if lines is not None else (lambda k: f"item {k + 1}")
            raise ValueError(
                f"{where}: {at(i)} repeats the id {pid!r} of {at(seen[pid])}; make ids unique or drop the id field"
            )
        seen[pid] = i
        pairs.append({"id": pid, "prompt": row[prompt_field], "response": row[response_field]})
    return pairs


def _read_jsonl_rows(path: Path) -> tuple[list[dict], list[int]]:
    """The objects of a JSONL file and their line numbers (blank lines skipped); UTF-8, with or
    without a byte-order mark. Raises ``ValueError`` naming the file and the line or byte offset."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"finetune.paths: {path} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}): re-save it as UTF-8"
        ) from None
    rows, lines = [], []
    for n, line in enumerate(text.split("\n"), 1):  # (not splitlines: U+2028 may sit inside a JSON string)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {n} is not JSON ({exc.msg}); one object per line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {n} is a {type(row).__name__}, not an object with fields")
        rows.append(row)
        lines.append(n)
    return rows, lines


def load_jsonl_pairs(path: str | Path, prompt_field: str = "prompt", response_field: str = "response") -> list[Pair]:
    """Pairs from a JSONL file (one object per line; blank lines skipped); ids are line numbers unless
    the objects carry an ``id``.

    Raises ``FileNotFoundError`` naming the file, ``ValueError`` naming the file and the byte offset
    for text that is not UTF-8 (a byte-order mark is fine), the line for bad JSON, the item and field
    for a missing field, a non-text value, an empty response or an empty file, and both lines of a
    repeated id.
    """
    return _load_jsonl(Path(path), prompt_field, response_field)[0]


def _load_jsonl(path: Path, prompt_field: str, response_field: str) -> tuple[list[Pair], list[dict], list[int]]:
    if not path.is_file():
        raise FileNotFoundError(f"finetune.paths: {path} does not exist; give a .jsonl file of prompt/response pairs")
    rows, lines = _read_jsonl_rows(path)
    return _check_pairs(rows, prompt_field, response_field, str(path), lines), rows, lines


def load_jsonl_pair_files(
    paths: Sequence[str | Path], prompt_field: str = "prompt", response_field: str = "response"
) -> tuple[list[Pair], list[Pair] | None]:
    """``(train, test)`` pairs of ``finetune.paths``: one file (``test`` None: split later) or a train
    and a test file (:func:`load_jsonl_pairs` each). Ids given in both files (an ``id`` field) must
    differ; ids by position may repeat across the files. Raises the loader's errors, and
    ``ValueError`` naming both files and lines of an id in both."""
    train, train_rows, train_lines = _load_jsonl(Path(paths[0]), prompt_field, response_field)
    if len(paths) < 2:
        return train, None
    test, test_rows, test_lines = _load_jsonl(Path(paths[1]), prompt_field, response_field)
    given = {str(r["id"]): n for r, n in zip(train_rows, train_lines) if "id" in r}
    for r, n in zip(test_rows, test_lines):
        if "id" in r and str(r["id"]) in given:
            raise ValueError(
                f"finetune.paths: {paths[1]} line {n} repeats the id {str(r['id'])!r} of {paths[0]} "
                f"line {given[str(r['id'])]}; make ids unique or drop the id field"
            )
    return train, test


def load_hf_pairs(name: str, split: str, prompt_field: str = "prompt", response_field: str = "response") -> list[Pair]:
    """Pairs from a Hugging Face dataset (``datasets.load_dataset(name, split=split)``, or
    ``load_from_disk`` for a local folder saved by ``save_to_disk``), fields mapped by name.

    Raises ``ValueError`` naming the missing field and the dataset's columns, ``ConnectionError``
    when the hub cannot be reached.
    """
    import datasets

    if Path(name).is_dir():
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"finetune.hf_split {split!r} is not a split of {name}; it has {sorted(ds)}")
            ds = ds[split]
    else:
        try:
            ds = datasets.load_dataset(name, split=split)
        except (ConnectionError, OSError) as exc:
            raise ConnectionError(
                f"finetune.hf_name {name!r} could not be loaded from the Hugging Face hub "
                f"({type(exc).__name__}); use finetune.source: jsonl with local files"
            ) from None
    missing = [f for f in (prompt_field, response_field) if f not in ds.column_names]
    if missing:
        raise ValueError(
            f"finetune.hf_name {name}: no column {missing[0]!r}; columns are {ds.column_names}; "
            "set finetune.prompt_field / finetune.response_field"
        )
    return _check_pairs(
        list(ds.select_columns([prompt_field, response_field])), prompt_field, response_field, f"{name}[{split}]"
    )


def split_items(
    n: int, test_fraction: float, seed: int, groups: Sequence[str] | None = None
) -> tuple[list[int], list[int]]:
    """Seeded train/test split of ``n`` items: ``(train indices, test indices)``, each ascending.

    With ``groups`` (e.g. each pair's play), every group is split on its own, so each group has
    ≈ ``test_fraction`` of its items in test (at least one when it has two or more).
    """
    rng = np.random.default_rng(seed)
    keys = list(groups) if groups is not None else [""] * n
    by: dict[str, list[int]] = collections.defaultdict(list)
    for i, g in enumerate(keys):
        by[g].append(i)
    test: list[int] = []
    for g in sorted(by):
        idx = by[g]
        k = int(round(test_fraction * len(idx))) if len(idx) > 1 else 0
        k = max(k, 1) if len(idx) > 1 else 0
        test.extend(int(i) for i in rng.permutation(idx)[:k])
    test_set = set(test)
    return [i for i in range(n) if i not in test_set], sorted(test_set)


def encode_pair(tokenizer, pair: Pair) -> tuple[list[int], list[int]]:
    """``(prompt ids, response ids)``: each encoded on its own, so the response's tokens are exactly
    the ones scored (the evaluation's context/continuation split is the same)."""
    return tokenizer.encode(pair["prompt"]).ids, tokenizer.encode(pair["response"]).ids


def pack_rows(
    examples: Sequence[tuple[list[int], list[int]]], row_len: int, eot_id: int, packing: bool = False
) -> tuple[np.ndarray, np.ndarray, dict]:
    """Rows of ``row_len`` (= S + 1) tokens and their target masks from ``(prompt ids, response ids)``.

    An example is ``prompt + response + [eot_id]``; the response and its closing ``eot_id`` are the
    targets (mask 1: the stop token is learnt), the prompt is not (mask 0). Padding (default): one
    example per row, padded with ``eot_id`` (mask 0). Packing: examples in order, a new row started
    when the next one does not fit, the rest padded. An example longer than a row loses prompt
    tokens from the left (then its stop token, then response tokens, from the right). Returns
    ``(ids int32[N, row_len], mask float32[N, row_len], info)`` with ``info`` counting
    ``truncated_prompts``, ``truncated_responses`` (responses cut, their stop token included),
    ``response_tokens`` (kept, stop tokens excluded) and ``target_tokens`` (what the loss counts:
    ``mask[:, 1:]`` summed, stop tokens included).
    """
    info = {"truncated_prompts": 0, "truncated_responses": 0, "response_tokens": 0, "target_tokens": 0}
    rows_ids: list[list[int]] = []
    rows_mask: list[list[int]] = []
    cur_ids: list[int] = []
    cur_mask: list[int] = []

    def close() -> None:
        nonlocal cur_ids, cur_mask
        if cur_ids:
            rows_ids.append(cur_ids + [eot_id] * (row_len - len(cur_ids)))
            rows_mask.append(cur_mask + [0] * (row_len - len(cur_mask)))
        cur_ids, cur_mask = [], []

    for prompt, response in examples:
        target = list(response) + [eot_id]  # the response and the stop token that closes it
        if len(target) > row_len - 1:
            target = target[: row_len - 1]
            info["truncated_responses"] += 1
        if len(prompt) + len(target) > row_len:
            prompt = prompt[len(prompt) + len(target) - row_len :]
            info["truncated_prompts"] += 1
        ids, mask = prompt + target, [0] * len(prompt) + [1] * len(target)
        info["response_tokens"] += min(len(response), len(target))
        if not packing:
            cur_ids, cur_mask = ids, mask
            close()
            continue
        if len(cur_ids) + len(ids) > row_len:
            close()
        cur_ids += ids
        cur_mask += mask
    close()
    ids_np, mask_np = np.asarray(rows_ids, np.int32), np.asarray(rows_mask, np.float32)
    info["target_tokens"] = int(mask_np[:, 1:].sum()) if len(mask_np) else 0
    return ids_np, mask_np, info


def auto_row_len(lengths: Sequence[int], max_inputs: int) -> int:
    """Row length S + 1 for examples of ``lengths`` tokens: the longest, with S rounded up to a
    multiple of 16, S at most ``max_inputs`` (the model's longest input)."""
    longest = max(lengths)
    S = min(max_inputs, max(16, -(-(longest - 1) // 16) * 16))
    return S + 1


def _digest(items: Sequence[Any]) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps(it, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()[:16]


def _majority_baseline(train: list[Pair], test: list[Pair]) -> float | None:
    """Accuracy of naming, for every test speech, the speaker with most train speeches in its play."""
    if not test or "title" not in test[0]:
        return None
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for p in train:
        counts[p["title"]][p["speaker"]] += 1
    hits = [counts[p["title"]].most_common(1)[0][0] == p["speaker"] if counts[p["title"]] else False for p in test]
    return float(np.mean(hits))


def _sample_test(n: int, limit: int | None, seed: int) -> list[int]:
    if limit is None or n <= limit:
        return list(range(n))
    return sorted(int(i) for i in np.random.default_rng(seed + 1).permutation(n)[:limit])


def text_task_pairs(
    ft: FinetuneConfig, task: str, split_seed: int, run_dir: str | Path
) -> tuple[list[Pair], list[Pair], dict]:
    """``(train pairs, test pairs, task info)`` of the text fine-tuning task ``task``
    (``cfg.finetune_task``) of the recipe ``ft`` (see module doc); items split and sampled with
    ``split_seed`` (``data.seed``).

    Raises ``ValueError`` when the task has fewer than 8 train or 4 test pairs, plus the loaders'
    errors.
    """
    info: dict[str, Any] = {"name": task, "modality": "text", "primary": "exact_match"}
    if task == "speakers":
        from data.store import load_heldout

        docs = load_heldout(run_dir, "finetune")
        pairs = speaker_pairs(docs, ft.speaker_context, ft.speaker_lines)
        tr, te = split_items(len(pairs), ft.test_fraction, split_seed, [p["title"] for p in pairs])
        train, test = [pairs[i] for i in tr], [pairs[i] for i in te]
        info["description"] = (
            "name the character who speaks a line of a play held out of pretraining, "
            f"given the title and the {ft.speaker_context} speeches before it with their speakers"
        )
        info["documents"] = [d["title"] for d in docs]
        info["speakers"] = len({(p["title"], p["speaker"]) for p in pairs})
        info["baselines"] = {
            "majority speaker of the play": _majority_baseline(train, test),
            "the speaker two speeches back": float(np.mean([p["two_back"] == p["speaker"] for p in test])),
        }
    else:
        if task == "jsonl":
            train, test = load_jsonl_pair_files(ft.paths, ft.prompt_field, ft.response_field)
            where = ft.paths[0]
        else:
            train = load_hf_pairs(ft.hf_name, ft.hf_split, ft.prompt_field, ft.response_field)
            test = (
                load_hf_pairs(ft.hf_name, ft.hf_test_split, ft.prompt_field, ft.response_field)
                if ft.hf_test_split
                else None
            )
            where = ft.hf_name
        if test is None:
            tr, te = split_items(len(train), ft.test_fraction, split_seed)
            train, test = [train[i] for i in tr], [train[i] for i in te]
        info["description"] = f"prompt/response pairs from {where}"
        info["baselines"] = {}
    test = [test[i] for i in _sample_test(len(test), ft.max_test_items, split_seed)]
    if len(train) < MIN_TRAIN_ITEMS or len(test) < MIN_TEST_ITEMS:
        raise ValueError(
            f"the fine-tuning task {task} has {len(train)} train and {len(test)} test pairs, fewer than "
            f"{MIN_TRAIN_ITEMS} and {MIN_TEST_ITEMS}; give more pairs"
            + (" (raise data.finetune_docs)" if task == "speakers" else "")
        )
    info.update(train_items=len(train), test_items=len(test))
    return train, test, info


def rotate_images(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every image at 0°, 90°, 180° and 270° (counter-clockwise): ``(uint8[4N, H, W, C], int32[4N])``,
    item 4i + k being image i turned k quarter turns, labelled k. Needs square images."""
    if images.shape[1] != images.shape[2]:
        raise ValueError(
            f"finetune.source rotation needs square images, got {images.shape[1]}×{images.shape[2]}; "
            "set data.image_size"
        )
    out = np.stack([np.rot90(images, k, axes=(1, 2)) for k in range(4)], axis=1)
    return out.reshape(-1, *images.shape[1:]), np.tile(np.arange(4, dtype=np.int32), len(images))


def _write_pairs(path: Path, pairs: list[Pair]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in pairs:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")


def read_pairs(path: str | Path) -> list[Pair]:
    """Pairs written by :func:`prepare_finetune_data` (``pairs_{train,test}.jsonl``)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prepare_finetune_data(
    ft: FinetuneConfig, task: str, data: DataConfig, run_dir: str | Path, out_dir: str | Path
) -> dict:
    """Build the items of the fine-tuning task ``task`` (``cfg.finetune_task``) of the recipe ``ft``
    into ``out_dir`` (``RUN/finetune/data``), from the data prepared in ``run_dir`` by ``data`` (its
    modality; ``data.seed`` splits and samples the items); returns its manifest.

    The manifest holds the task (``name``, ``modality``, ``primary`` metric, ``description``,
    ``train_items``, ``test_items``, ``baselines``), ``row_len`` and the rows' counts (text), a
    digest of each split's items, and the config it was built from (``finetune`` section and
    seed). The same config and run give the same files. Raises the errors of
    :func:`text_task_pairs` and ``FileNotFoundError`` for missing prepared data.
    """
    from data.store import load_manifest

    out_dir = Path(out_dir)
    data_manifest = load_manifest(run_dir)
    record = {"finetune": ft.model_dump(mode="json", exclude={"enabled"}), "seed": data.seed}
    if data.modality == "image":
        from data.images import load_image_rows

        val, test_rows = load_image_rows(run_dir, "val"), load_image_rows(run_dir, "test")
        tr_x, tr_y = rotate_images(np.asarray(val["image"]))
        te_x, te_y = rotate_images(np.asarray(test_rows["image"]))
        keep = _sample_test(len(te_y), ft.max_test_items, data.seed)
        te_x, te_y = te_x[keep], te_y[keep]
        manifest = {
            "name": "rotation",
            "modality": "image",
            "primary": "accuracy",
            "description": "which of 0°, 90°, 180° or 270° a held-out image was turned by (a new 4-way head)",
            "classes": [f"{r}°" for r in ROTATIONS],
            "num_classes": len(ROTATIONS),
            "train_items": int(len(tr_y)),
            "test_items": int(len(te_y)),
            "baselines": {"chance": 1.0 / len(ROTATIONS)},
            "digests": {"train": _digest(tr_y.tolist()), "test": _digest(keep)},
        }

        def write(tmp: Path) -> None:
            np.savez(tmp / "train.npz", image=tr_x, label=tr_y)
            np.savez(tmp / "test.npz", image=te_x, label=te_y)
            (tmp / "manifest.json").write_text(json.dumps({**manifest, "config": record}, indent=2))
    else:
        from data.store import load_tokenizer

        tok = load_tokenizer(run_dir)
        eot = int(tok.token_to_id(EOT))
        train, test, manifest = text_task_pairs(ft, task, data.seed, run_dir)
        enc_train = [encode_pair(tok, p) for p in train]
        enc_test = [encode_pair(tok, p) for p in test]
        lengths = [len(a) + len(b) + 1 for a, b in enc_train + enc_test]  # + the closing EOT
        row_len = ft.seq_len + 1 if ft.seq_len else auto_row_len(lengths, int(data_manifest["seq_len"]))
        tr_ids, tr_mask, tr_info = pack_rows(enc_train, row_len, eot, ft.packing)
        te_ids, te_mask, te_info = pack_rows(enc_test, row_len, eot, False)
        manifest.update(
            row_len=row_len,
            packing=ft.packing,
            train_rows=int(len(tr_ids)),
            test_rows=int(len(te_ids)),
            train_response_tokens=tr_info["response_tokens"],
            train_target_tokens=tr_info["target_tokens"],
            truncated={
                "prompts": tr_info["truncated_prompts"] + te_info["truncated_prompts"],
                "responses": tr_info["truncated_responses"] + te_info["truncated_responses"],
            },
            longest_pair_tokens=int(max(lengths)),
            longest_response_tokens=int(max(len(b) for _, b in enc_train + enc_test)),
            digests={"train": _digest([p["id"] for p in train]), "test": _digest([p["id"] for p in test])},
        )

        def write(tmp: Path) -> None:
            _write_pairs(tmp / PAIRS_FILE.format(split="train"), train)
            _write_pairs(tmp / PAIRS_FILE.format(split="test"), test)
            np.savez(tmp / "train.npz", ids=tr_ids, mask=tr_mask)
            np.savez(tmp / "test.npz", ids=te_ids, mask=te_mask)
            (tmp / "manifest.json").write_text(json.dumps({**manifest, "config": record}, indent=2, ensure_ascii=False))

    existing = out_dir / "manifest.json"
    if existing.is_file():
        old = json.loads(existing.read_text())
        if old.get("config") == record:
            return old
    with atomic.folder(out_dir) as tmp:
        write(tmp)
    return {**manifest, "config": record}


def load_finetune_rows(data_dir: str | Path, split: str) -> dict[str, np.ndarray]:
    """The rows of ``split`` (``train`` or ``test``): text ``{"ids", "mask"}``, images ``{"image", "label"}``."""
    path = Path(data_dir) / f"{split}.npz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; prepare the fine-tuning data again")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}
