"""Bad input is refused before any work, in one line, and never touches an existing run.

One test per kind of fault found by trying the pipeline as a new user would (issue 8): a refused
run that wrote into a finished run's directory, checks that only ran after Prefect started, text
that was not text, configs that meant something other than what was written, and chaos that could
not happen.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from configs.schema import ExperimentConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, env=None, timeout=180):
    """``ddiloco ARGS`` in a subprocess: (exit code, stderr)."""
    out = subprocess.run([sys.executable, "-m", "flows.cli", *map(str, args)], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return out.returncode, out.stderr


def one_line_refusal(code: int, err: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err  # nothing else printed: Prefect never started
    assert "Starting temporary server" not in err
    return lines[0]


# -- 1. nothing is written to a run directory until every check has passed ----------------------
def finished_run(path: Path) -> bytes:
    (path / "pretrain" / "diloco").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"diloco": {"outer_lr": 0.8}}))
    (path / "status.json").write_text(json.dumps({"status": "completed", "completed_stages": ["report"]}))
    return (path / "config.json").read_bytes()


def test_a_refused_run_never_touches_a_finished_run(tmp_path):
    before = finished_run(tmp_path / "R")
    listing = sorted(p.name for p in (tmp_path / "R").rglob("*"))
    line = one_line_refusal(*cli("run", "configs/tiny.yaml", "--run-dir", tmp_path / "R",
                                 "--set", "diloco.outer_lr=0.5"))
    assert "already holds a run (completed" in line and "--run-dir" in line
    assert (tmp_path / "R" / "config.json").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "R").rglob("*")) == listing


def test_run_dir_rules(tmp_path):
    from run.directory import check_run_dir

    assert check_run_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    (tmp_path / "empty").mkdir()
    check_run_dir(tmp_path / "empty")
    (tmp_path / "data-only" / "data").mkdir(parents=True)  # an earlier run's data, reused when it matches
    check_run_dir(tmp_path / "data-only")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty .*notes.txt"):
        check_run_dir(tmp_path / "other")
    (tmp_path / "partial" / "checkpoints").mkdir(parents=True)  # an interrupted run is a run too
    with pytest.raises(ValueError, match="already holds a run"):
        check_run_dir(tmp_path / "partial")
    assert not (tmp_path / "new").exists()  # checking writes nothing


# -- 2. every check that can run before Prefect and JAX start does -------------------------------
def test_run_dir_under_a_file_is_refused_before_prefect_starts(tmp_path):
    (tmp_path / "a-file").write_text("")
    line = one_line_refusal(*cli("run", "tiny", "--run-dir", tmp_path / "a-file" / "R"))
    assert "is a file, not a folder" in line and "--run-dir" in line


def corpus(tmp_path: Path, texts: list[str | bytes]) -> list[str]:
    paths = []
    for i, t in enumerate(texts):
        p = tmp_path / f"doc{i}.txt"
        p.write_bytes(t if isinstance(t, bytes) else t.encode())
        paths.append(str(p))
    return paths


@pytest.mark.parametrize("texts, needle", [
    ([""] * 6, "empty corpus"),
    (["   \n\t \n"] * 6, "empty corpus"),
    (["one play, no more\n" * 50], "holds 1 non-empty document"),
])
def test_corpus_too_small_is_refused_before_prefect_starts(tmp_path, texts, needle):
    paths = corpus(tmp_path, texts)
    line = one_line_refusal(*cli("run", "tiny", "--run-dir", tmp_path / "R", "--set", "data.source=local",
                                 "--set", f"data.paths=[{', '.join(paths)}]"))
    assert needle in line
    assert not (tmp_path / "R").exists()


def test_hub_dataset_while_offline_is_refused_before_prefect_starts(tmp_path):
    line = one_line_refusal(*cli("run", "tiny", "--run-dir", tmp_path / "R", "--set", "data.source=hf",
                                 "--set", "data.hf_name=wikitext", env={"HF_HUB_OFFLINE": "1"}))
    assert "data.hf_name 'wikitext'" in line and "data.source: local" in line
    assert not (tmp_path / "R").exists()


# -- 3. text that is not text is refused, unless its encoding is named -------------------------
def test_latin1_and_binary_files_are_refused_naming_file_and_offset(tmp_path):
    from configs.schema import DataConfig
    from tasks.data import check_corpus

    latin = corpus(tmp_path, ["café ".encode("latin-1") * 200 for _ in range(6)])
    with pytest.raises(ValueError, match=r"doc0.txt is not valid UTF-8 \(byte 0xe9 at offset 3\).*data.encoding"):
        check_corpus(DataConfig(source="local", paths=latin))
    info = check_corpus(DataConfig(source="local", paths=latin, encoding="latin-1"))
    assert info == {"documents": 6}
    from tasks.data import read_local

    assert read_local(latin[:1], encoding="latin-1")[0]["text"].startswith("café café")
    rng = __import__("random").Random(0)
    binary = [bytes(rng.randrange(256) for _ in range(3000)) for _ in range(6)]
    (tmp_path / "bin").mkdir()
    noise = corpus(tmp_path / "bin", binary)
    with pytest.raises(ValueError, match=r"doc0.txt is not valid UTF-8 \(byte 0x[0-9a-f]{2} at offset \d+\)"):
        check_corpus(DataConfig(source="local", paths=noise))
    with pytest.raises(ValueError, match=r"doc0.txt does not look like text \(\d+ control characters"):
        check_corpus(DataConfig(source="local", paths=noise, encoding="latin-1"))
    (tmp_path / "nul.txt").write_bytes(b"valid utf-8 but \x00 binary\n" * 10)
    with pytest.raises(ValueError, match="nul.txt does not look like text"):
        read_local([str(tmp_path / "nul.txt")])


def test_cli_refuses_latin1_corpus_in_one_line(tmp_path):
    paths = corpus(tmp_path, ["café ".encode("latin-1") * 200 for _ in range(6)])
    line = one_line_refusal(*cli("validate", "tiny", "--set", "data.source=local",
                                 "--set", f"data.paths=[{', '.join(paths)}]"))
    assert "not valid UTF-8 (byte 0xe9 at offset 3)" in line


def test_unknown_encoding_names_the_field():
    with pytest.raises(ValidationError, match="data.encoding 'klingon' is not a known text encoding"):
        ExperimentConfig.model_validate({"data": {"encoding": "klingon"}})


# -- 4. configs mean what was written ----------------------------------------------------------
def test_empty_config_is_an_error(tmp_path):
    for text in ("", "# only a comment\n\n"):
        (tmp_path / "e.yaml").write_text(text)
        with pytest.raises(ValueError, match="is empty"):
            load_config(tmp_path / "e.yaml")
        line = one_line_refusal(*cli("validate", tmp_path / "e.yaml"))
        assert "e.yaml is empty" in line


@pytest.mark.parametrize("section, field, value", [
    ("diloco", "learners", True),
    ("diloco", "learners", "4"),
    ("diloco", "outer_lr", "0.5"),
    ("diloco", "keep_in_flight", "yes"),
    ("diloco", "keep_in_flight", 1),
    ("train", "token_budget", 2e6),
    ("data", "seq_len", False),
    ("eval", "enabled", 0),
])
def test_no_coercion_from_booleans_or_strings(section, field, value):
    with pytest.raises(ValidationError) as exc:
        ExperimentConfig.model_validate({section: {field: value}})
    assert f"{section}.{field}" in str(exc.value).replace("\n", ".")


def test_yaml_numbers_are_numbers(tmp_path):
    (tmp_path / "c.yaml").write_text("diloco: {inner: {lr: 3e-4}, outer_lr: 1}\ntrain: {token_budget: 2_000_000}\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.diloco.inner.lr == 3e-4 and cfg.diloco.outer_lr == 1.0 and cfg.train.token_budget == 2_000_000
    with pytest.raises(ValidationError, match="learners"):
        load_config(tmp_path / "c.yaml", {"diloco.learners": True})


def test_config_by_shipped_name_or_path():
    from configs.schema import config_path, resolve_config

    assert config_path("tiny") == ROOT / "configs" / "tiny.yaml"
    assert config_path(str(ROOT / "configs" / "tiny.yaml")).name == "tiny.yaml"
    with pytest.raises(FileNotFoundError, match="shipped: default, failure, tiny"):
        config_path("nope")
    cfg = resolve_config(ExperimentConfig(), "tiny", {"diloco.learners": 2, "diloco.quorum": 1})
    assert cfg.name == "tiny" and cfg.diloco.learners == 2
    assert resolve_config(cfg) is cfg


# -- 5. chaos that cannot happen is refused ------------------------------------------------------
def test_unreachable_chaos_step_is_refused():
    tiny = load_config(ROOT / "configs" / "tiny.yaml")
    assert tiny.learner_steps == 64
    with pytest.raises(ValidationError, match=r"chaos.failures\[0\].at_step \(100000\) cannot happen.*≤ 64"):
        load_config(ROOT / "configs" / "tiny.yaml", {"chaos.failures": [{"learner": 0, "at_step": 100000}]})
    load_config(ROOT / "configs" / "tiny.yaml", {"chaos.failures": [{"learner": 0, "at_step": 64}]})
