"""Text preparation: corpus → held-out split → byte-level BPE → packed sequences → per-learner shards.

Plain functions, no Prefect import; ``tasks.shard.shard_data_task`` is the thin Prefect wrapper
around :func:`prepare_data`.

Run directory layout written by :func:`prepare_data` (see ``docs/contracts.md``, "Data")::

    RUN/data/tokenizer.json          byte-level BPE, trained on the training split only
    RUN/data/train/                  datasets.Dataset (save_to_disk), column ``ids`` int32 [T+1]
    RUN/data/shard_{m:02d}/          learner m's sequences (round-robin; disjoint, cover train)
    RUN/data/val/                    packed validation sequences (same format)
    RUN/data/heldout_{val,test}.jsonl  raw held-out documents, one {"title", "text"} per line
    RUN/data/heldout_finetune.jsonl  the plays held out for fine-tuning (``data.finetune_docs`` > 0)
    RUN/data/manifest.json           what was built, with counts (see :func:`prepare_data`)

Shapes: ``N`` sequences, ``T`` = ``cfg.data.seq_len``; a sequence holds ``T + 1`` token ids
(inputs ``[:-1]``, targets ``[1:]``), so each predicts ``T`` tokens. Token ids are int32.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import time
from pathlib import Path

import numpy as np

from configs.data import DataConfig, TextDataConfig
from data.sources import DATA_DIR, EOT, MANIFEST_VERSION, SPLITS, Document, load_documents, split_documents
from data.store import load_manifest
from run import atomic
from run.layout import HELDOUT_FILE

log = logging.getLogger(__name__)


def train_tokenizer(texts: list[str], vocab_size: int):
    """Train a byte-level BPE on ``texts`` (the training split only).

    ByteLevel pre-tokenizer (GPT-2 regex, no prefix space) and decoder, ``BpeTrainer`` with the
    256-symbol byte alphabet and one special token ``<|endoftext|>`` (id 0, the document separator
    and EOT). The result has at most ``vocab_size`` entries (fewer if the corpus runs out of
    merges). Returns a ``tokenizers.Tokenizer``; decoding an encoding gives back the text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


# Split points where a lone "\n" sits between two non-space characters: the GPT-2 pattern of the
# ByteLevel pre-tokenizer always makes such a newline its own pre-token, so encoding the pieces
# separately gives exactly the ids of encoding the whole document (tested), and is faster than
# encoding 100-kB strings whole.
_CHUNK_SPLIT = re.compile(r"(?<=\S\n)(?=\S)")


def tokenize_documents(tokenizer, texts: list[str]) -> np.ndarray:
    """Encode documents and join them, each followed by the EOT id.

    Documents are cut at safe newlines (see ``_CHUNK_SPLIT``) and encoded in one batched call
    (``encode_batch_fast``, or ``encode_batch`` on older ``tokenizers``), so the ids equal those
    of ``tokenizer.encode(text).ids``. Returns a 1-D int32 array of ``sum(len(ids_i) + 1)`` ids.
    """
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise ValueError(f"the tokenizer has no {EOT} token")
    if not texts:
        return np.zeros(0, np.int32)
    pieces, counts = [], []
    for text in texts:
        parts = _CHUNK_SPLIT.split(text)
        pieces.extend(parts)
        counts.append(len(parts))
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    encs = encode(pieces, add_special_tokens=False)
    lists: list[list[int]] = []
    i = 0
    for c in counts:
        lists.extend(e.ids for e in encs[i : i + c])
        lists.append([eot])
        i += c
    total = sum(len(x) for x in lists)
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int32, count=total)


def pack_sequences(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut a token stream into non-overlapping rows of ``seq_len + 1`` ids; drop the remainder.

    ``tokens``: 1-D int array of length L. Returns int32 ``[L // (seq_len + 1), seq_len + 1]``.
    """
    width = seq_len + 1
    n = len(tokens) // width
    return np.ascontiguousarray(np.asarray(tokens[: n * width], dtype=np.int32).reshape(n, width))


def shard_name(m: int) -> str:
    """``shard_{m:02d}``, learner m's data folder name."""
    return f"shard_{m:02d}"


def _sequences_dataset(seqs: np.ndarray):
    from datasets import Dataset, Features, List, Value

    width = seqs.shape[1]
    features = Features({"ids": List(Value("int32"), length=width)})
    return Dataset.from_dict({"ids": seqs}, features=features)


# ---------------------------------------------------------------------------------------------
# The whole step
# ---------------------------------------------------------------------------------------------


def config_record(data: DataConfig, learners: int) -> dict:
    """What determines the data folder: the ``data`` section and the number of ``learners`` (M)."""
    d = data.model_dump(mode="json")
    d.pop("cache_dir", None)  # where the archive is cached does not change the data
    return {"data": d, "learners": learners}


def _write_jsonl(path: Path, docs: list[Document]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"title": d["title"], "text": d["text"]}, ensure_ascii=False) + "\n")


def prepare_data(
    dcfg: TextDataConfig, learners: int, run_dir: str | Path, overwrite: bool = False, *, eval_rows: int
) -> dict:
    """Build ``RUN/data``: tokenizer, packed train/val sequences, M shards, held-out docs, manifest.

    Steps: load the corpus (:func:`load_documents`), hold out whole documents
    (:func:`split_documents`), train the BPE on the training split (:func:`train_tokenizer`),
    tokenize and join with EOT, pack into ``[N, seq_len+1]`` int32 rows, and split the training
    rows round-robin into ``learners`` (M, ``diloco.learners``) disjoint shards (``Dataset.shard(...,
    contiguous=False)``: shard m holds rows m, m+M, m+2M, ...; so every learner sees every
    document's share and shard sizes differ by at most one).

    Everything is built in a temporary folder inside ``run_dir`` and renamed to ``RUN/data`` at
    the end: a failure never leaves a half-written ``RUN/data``. ``eval_rows``: the val sequences one
    held-out evaluation reads (``train.eval_batches × train.eval_batch_size``); fewer are warned about.

    If ``RUN/data`` already holds a manifest built from the same data config and learner count,
    it is reused (returned as is). A different or incomplete ``RUN/data`` raises
    ``FileExistsError`` unless ``overwrite=True``, which replaces it.

    Returns the manifest dict (also written to ``RUN/data/manifest.json``): ``source``,
    ``sha256`` (archive, or None), ``config``, ``vocab_size`` (actual, ≤ ``data.vocab_size``),
    ``eot_id``, ``seq_len``, ``learners``, ``tokenizer`` (path relative to RUN), ``splits``
    (per split: ``documents``, ``titles``, ``characters``, ``tokens`` including one EOT per
    document, and for train/val ``sequences`` and ``predicted_tokens`` = seq_len × sequences),
    ``shards`` (list of ``{name, path, sequences, tokens}``, tokens = seq_len × sequences),
    ``elapsed_s`` (wall seconds, imports included) and ``stages_s`` (per stage).

    Raises the errors of :func:`load_documents` and :func:`split_documents`, ``ValueError`` when
    the training or validation split is too short for one sequence of ``data.seq_len + 1``
    tokens, and ``FileExistsError`` as above.
    """
    t0 = time.perf_counter()
    import datasets
    import tokenizers  # noqa: F401  (timed in the "import" stage; read in _data_manifest)

    stages: dict[str, float] = {}
    lap = [t0]

    def _lap(name: str) -> None:
        now = time.perf_counter()
        stages[name] = round(now - lap[0], 3)
        lap[0] = now

    run_dir = Path(run_dir)
    final = run_dir / DATA_DIR
    record = config_record(dcfg, learners)
    old = _reusable_manifest(run_dir, record, overwrite)
    if old is not None:
        return old

    M = learners
    T = dcfg.seq_len
    datasets.disable_progress_bars()

    _lap("import")
    docs, info = load_documents(dcfg)
    splits = split_documents(docs, dcfg.val_docs, dcfg.test_docs, dcfg.seed, dcfg.finetune_docs)
    _lap("load")
    log.info(
        "documents: %d train, %d val, %d test, %d fine-tuning",
        *(len(splits[s]) for s in (*SPLITS, "finetune")),
    )

    run_dir.mkdir(parents=True, exist_ok=True)
    with atomic.folder(final) as tmp:  # the old folder goes only once the new one is in
        tok = train_tokenizer([d["text"] for d in splits["train"]], dcfg.vocab_size)
        tok.save(str(tmp / "tokenizer.json"))
        _lap("train_tokenizer")

        split_info, packed = _encode_splits(tok, splits, T)
        _lap("encode")
        shards = _save_sequences(tmp, packed, M, T)
        _lap("save")
        _save_heldout(tmp, splits, split_info)

        manifest = _data_manifest(dcfg, M, eval_rows, info, record, tok, split_info, shards, stages)
        manifest["elapsed_s"] = round(time.perf_counter() - t0, 3)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False))

    log.info(
        "data ready in %.1f s: %d train sequences, %d val, vocab %d",
        manifest["elapsed_s"], split_info["train"]["sequences"], split_info["val"]["sequences"],
        manifest["vocab_size"],
    )  # fmt: skip
    return manifest


def _data_manifest(
    dcfg, learners: int, want: int, info: dict, record: dict, tok, split_info: dict, shards: list, stages: dict
) -> dict:
    """The manifest of :func:`prepare_data` (``elapsed_s`` left None); warns when val holds fewer
    sequences than one evaluation reads (``want``)."""
    import datasets
    import tokenizers

    if split_info["val"]["sequences"] < want:
        log.warning(
            "val has %d sequences, fewer than train.eval_batches × train.eval_batch_size = %d",
            split_info["val"]["sequences"], want,
        )  # fmt: skip
    return {
        "manifest_version": MANIFEST_VERSION,
        **info,
        "config": record,
        "vocab_size": int(tok.get_vocab_size()),
        "vocab_size_requested": dcfg.vocab_size,
        "eot_token": EOT,
        "eot_id": int(tok.token_to_id(EOT)),
        "seq_len": dcfg.seq_len,
        "learners": learners,
        "tokenizer": f"{DATA_DIR}/tokenizer.json",
        "splits": split_info,
        "shards": shards,
        "versions": {"datasets": datasets.__version__, "tokenizers": tokenizers.__version__},
        "elapsed_s": None,
        "stages_s": stages,
    }


def _reusable_manifest(run_dir: Path, record: dict, overwrite: bool) -> dict | None:
    """The manifest of an existing ``RUN/data`` built from ``record``, to reuse; None when there is
    none or ``overwrite``; ``FileExistsError`` for a different or incomplete one without ``overwrite``."""
    final = run_dir / DATA_DIR
    if not final.exists():
        return None
    try:
        old = load_manifest(run_dir)
    except (FileNotFoundError, ValueError):
        old = None
    if overwrite:
        return None
    if old is not None and old.get("config") == record:
        log.info("reusing %s (built from the same data config)", final)
        return old
    raise FileExistsError(
        f"{final} already exists and was built from a different (or no) data config; "
        "pass overwrite=True or use a new run directory"
    )


def _encode_splits(tok, splits: dict, T: int) -> tuple[dict[str, dict], dict[str, np.ndarray]]:
    """Tokenize each split and pack train/val/test into ``[N, T+1]`` rows: (split info, packed rows).
    ``ValueError`` when train or val is too short for one sequence."""
    split_info: dict[str, dict] = {}
    packed: dict[str, np.ndarray] = {}
    for s in SPLITS:
        texts = [d["text"] for d in splits[s]]
        stream = tokenize_documents(tok, texts)
        split_info[s] = {
            "documents": len(texts),
            "titles": [d["title"] for d in splits[s]],
            "characters": int(sum(len(t) for t in texts)),
            "tokens": int(len(stream)),
        }
        if s == "test":  # the headline figures' split (training.evaluation.final_heldout)
            seqs = pack_sequences(stream, T)
            if len(seqs):
                packed[s] = seqs
                split_info[s]["sequences"] = int(len(seqs))
        if s in ("train", "val"):
            seqs = pack_sequences(stream, T)
            if len(seqs) == 0:
                raise ValueError(
                    f"the {s} split has {len(stream)} tokens, fewer than one sequence of "
                    f"data.seq_len + 1 = {T + 1}; lower data.seq_len or hold out longer "
                    f"documents (data.seed, data.val_docs)"
                )
            packed[s] = seqs
            split_info[s]["sequences"] = int(len(seqs))
            split_info[s]["predicted_tokens"] = int(len(seqs) * T)
    return split_info, packed


def _save_sequences(tmp: Path, packed: dict[str, np.ndarray], M: int, T: int) -> list[dict]:
    """Save the packed splits and the M round-robin training shards under ``tmp``; the shard
    records. ``ValueError`` when a shard would be empty."""
    train_ds = _sequences_dataset(packed["train"])
    train_ds.save_to_disk(str(tmp / "train"))
    _sequences_dataset(packed["val"]).save_to_disk(str(tmp / "val"))
    if "test" in packed:
        _sequences_dataset(packed["test"]).save_to_disk(str(tmp / "test"))
    shards = []
    for m in range(M):
        sh = train_ds.shard(num_shards=M, index=m, contiguous=False)
        sh.save_to_disk(str(tmp / shard_name(m)))
        shards.append(
            {
                "name": shard_name(m),
                "path": f"{DATA_DIR}/{shard_name(m)}",
                "sequences": int(len(sh)),
                "tokens": int(len(sh) * T),
            }
        )
    if any(sh["sequences"] == 0 for sh in shards):
        raise ValueError(
            f"{packed['train'].shape[0]} training sequences cannot fill "
            f"diloco.learners = {M} shards; lower diloco.learners or data.seq_len"
        )
    return shards


def _save_heldout(tmp: Path, splits: dict, split_info: dict[str, dict]) -> None:
    """Write the held-out documents as JSONL; record the fine-tuning split in ``split_info``."""
    _write_jsonl(tmp / HELDOUT_FILE.format(split="val"), splits["val"])
    _write_jsonl(tmp / HELDOUT_FILE.format(split="test"), splits["test"])
    if splits["finetune"]:
        _write_jsonl(tmp / HELDOUT_FILE.format(split="finetune"), splits["finetune"])
        split_info["finetune"] = {
            "documents": len(splits["finetune"]),
            "titles": [d["title"] for d in splits["finetune"]],
            "characters": int(sum(len(d["text"]) for d in splits["finetune"])),
        }


# ---------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------
