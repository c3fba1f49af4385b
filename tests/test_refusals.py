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

from configs.load import load_config
from configs.schema import ExperimentConfig

ROOT = Path(__file__).resolve().parents[1]


def cli_process(*args, env=None, timeout=180):
    """``ddiloco ARGS`` in a fresh Python process: (exit code, stderr)."""
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return out.returncode, out.stderr


def cli(*args):
    """``ddiloco ARGS`` in this process (typer's runner): (exit code, stderr). A refusal comes before
    Prefect or JAX start, so this is the same code path as a fresh process (:func:`cli_process`, kept
    for the tests where a fresh process matters) without paying an interpreter's start-up each time;
    an exception escaping the command exits 1 here, and the refusal checks want 2."""
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, [*map(str, args)])
    return result.exit_code, result.stderr


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
    os.utime(tmp_path / "R", (0, 0))  # nothing may be created in it, not even a probe folder
    line = one_line_refusal(
        *cli_process("run", "configs/tiny.yaml", "--run-dir", tmp_path / "R", "--set", "diloco.outer_lr=0.5")
    )
    assert "already holds a run (completed" in line and "--run-dir" in line
    assert (tmp_path / "R" / "config.json").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "R").rglob("*")) == listing
    assert (tmp_path / "R").stat().st_mtime == 0


def test_an_old_key_names_what_replaced_it():
    line = one_line_refusal(*cli("validate", "tiny", "--set", "diloco.keep_in_flight=true"))
    assert "diloco.keep_in_flight" in line and "replaced by diloco.receipt: keep_in_flight" in line


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
    (tmp_path / "partial" / "pretrain" / "dp" / "checkpoints").mkdir(parents=True)  # an interrupted run
    with pytest.raises(ValueError, match="already holds a run"):  # is a run too
        check_run_dir(tmp_path / "partial")
    (tmp_path / "old-layout" / "checkpoints").mkdir(parents=True)  # and so is one of the layout before
    with pytest.raises(ValueError, match="already holds a run"):
        check_run_dir(tmp_path / "old-layout")
    assert not (tmp_path / "new").exists()  # checking writes nothing


# -- 2. every check that can run before Prefect and JAX start does -------------------------------
def test_run_dir_under_a_file_is_refused_before_prefect_starts(tmp_path):
    (tmp_path / "a-file").write_text("")
    line = one_line_refusal(*cli("run", "tiny", "--run-dir", tmp_path / "a-file" / "R"))
    assert "is a file, not a folder" in line and "--run-dir" in line


def test_object_storage_run_dirs_are_refused_in_one_line(tmp_path):
    """Runs are written to local folders; a URL as --run-dir or run_root is refused before anything."""
    line = one_line_refusal(*cli("run", "tiny", "--run-dir", "s3://bucket/run"))
    assert "s3://bucket/run is a URL" in line and "local" in line
    line = one_line_refusal(*cli("run", "tiny", "--set", "run_root=memory://runs"))
    assert "run_root memory://runs is a URL" in line


def corpus(tmp_path: Path, texts: list[str | bytes]) -> list[str]:
    paths = []
    for i, t in enumerate(texts):
        p = tmp_path / f"doc{i}.txt"
        p.write_bytes(t if isinstance(t, bytes) else t.encode())
        paths.append(str(p))
    return paths


@pytest.mark.parametrize(
    "texts, needle",
    [
        ([""] * 6, "empty corpus"),
        (["   \n\t \n"] * 6, "empty corpus"),
        (["one play, no more\n" * 50], "holds 1 non-empty document"),
    ],
)
def test_corpus_too_small_is_refused_before_prefect_starts(tmp_path, texts, needle):
    paths = corpus(tmp_path, texts)
    line = one_line_refusal(
        *cli(
            "run",
            "tiny",
            "--run-dir",
            tmp_path / "R",
            "--set",
            "data.source=local",
            "--set",
            f"data.paths=[{', '.join(paths)}]",
        )
    )
    assert needle in line
    assert not (tmp_path / "R").exists()


@pytest.mark.slow
def test_hub_dataset_while_offline_is_refused_before_prefect_starts(tmp_path):
    line = one_line_refusal(
        *cli_process(
            "run",
            "tiny",
            "--run-dir",
            tmp_path / "R",
            "--set",
            "data.source=hf",
            "--set",
            "data.hf_name=wikitext",
            env={"HF_HUB_OFFLINE": "1"},
        )
    )
    assert "data.hf_name 'wikitext'" in line and "data.source: local" in line
    assert not (tmp_path / "R").exists()


# -- 3. text that is not text is refused, unless its encoding is named -------------------------
def test_latin1_and_binary_files_are_refused_naming_file_and_offset(tmp_path):
    from configs.data import TextDataConfig
    from data.sources import check_corpus

    latin = corpus(tmp_path, ["café ".encode("latin-1") * 200 for _ in range(6)])
    with pytest.raises(ValueError, match=r"doc0.txt is not valid UTF-8 \(byte 0xe9 at offset 3\).*data.encoding"):
        check_corpus(TextDataConfig(source="local", paths=latin))
    info = check_corpus(TextDataConfig(source="local", paths=latin, encoding="latin-1"))
    assert info == {"documents": 6}
    from data.sources import read_local

    assert read_local(latin[:1], encoding="latin-1")[0]["text"].startswith("café café")
    rng = __import__("random").Random(0)
    binary = [bytes(rng.randrange(256) for _ in range(3000)) for _ in range(6)]
    (tmp_path / "bin").mkdir()
    noise = corpus(tmp_path / "bin", binary)
    with pytest.raises(ValueError, match=r"doc0.txt is not valid UTF-8 \(byte 0x[0-9a-f]{2} at offset \d+\)"):
        check_corpus(TextDataConfig(source="local", paths=noise))
    with pytest.raises(ValueError, match=r"doc0.txt does not look like text \(\d+ control characters"):
        check_corpus(TextDataConfig(source="local", paths=noise, encoding="latin-1"))
    (tmp_path / "nul.txt").write_bytes(b"valid utf-8 but \x00 binary\n" * 10)
    with pytest.raises(ValueError, match="nul.txt does not look like text"):
        read_local([str(tmp_path / "nul.txt")])


def test_cli_refuses_latin1_corpus_in_one_line(tmp_path):
    paths = corpus(tmp_path, ["café ".encode("latin-1") * 200 for _ in range(6)])
    line = one_line_refusal(
        *cli("validate", "tiny", "--set", "data.source=local", "--set", f"data.paths=[{', '.join(paths)}]")
    )
    assert "not valid UTF-8 (byte 0xe9 at offset 3)" in line


def test_unknown_encoding_names_the_field():
    with pytest.raises(ValidationError, match="data.encoding 'klingon' is not a known text encoding"):
        ExperimentConfig.model_validate({"data": {"source": "local", "paths": ["a.txt"], "encoding": "klingon"}})
    with pytest.raises(ValidationError, match="data.encoding applies to local .txt files"):
        ExperimentConfig.model_validate({"data": {"encoding": "latin-1"}})  # the embedded corpus has its own


# -- 4. configs mean what was written ----------------------------------------------------------
def test_empty_config_is_an_error(tmp_path):
    for text in ("", "# only a comment\n\n"):
        (tmp_path / "e.yaml").write_text(text)
        with pytest.raises(ValueError, match="is empty"):
            load_config(tmp_path / "e.yaml")
        line = one_line_refusal(*cli("validate", tmp_path / "e.yaml"))
        assert "e.yaml is empty" in line


@pytest.mark.parametrize(
    "section, field, value",
    [
        ("diloco", "learners", True),
        ("diloco", "learners", "4"),
        ("diloco", "outer_lr", "0.5"),
        ("diloco", "outer_nesterov", "yes"),
        ("diloco", "outer_nesterov", 1),
        ("diloco", "receipt", True),
        ("dp", "batch_size", "32"),
        ("train", "token_budget", 2e6),
        ("data", "seq_len", False),
        ("eval", "enabled", 0),
    ],
)
def test_no_coercion_from_booleans_or_strings(section, field, value):
    with pytest.raises(ValidationError) as exc:
        ExperimentConfig.model_validate({section: {field: value}})
    from configs.load import validation_lines

    assert validation_lines(exc.value)[0].startswith(f"{section}.{field}: "), validation_lines(exc.value)


def test_yaml_numbers_are_numbers(tmp_path):
    (tmp_path / "c.yaml").write_text("diloco: {inner: {lr: 3e-4}, outer_lr: 1}\ntrain: {token_budget: 2_000_000}\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.diloco.inner.lr == 3e-4 and cfg.diloco.outer_lr == 1.0 and cfg.train.token_budget == 2_000_000
    with pytest.raises(ValidationError, match="learners"):
        load_config(tmp_path / "c.yaml", {"diloco.learners": True})


def test_config_by_shipped_name_or_path():
    from configs.load import config_path
    from configs.specs import load_spec

    assert config_path("tiny") == ROOT / "configs" / "tiny.yaml"
    assert config_path(str(ROOT / "configs" / "tiny.yaml")).name == "tiny.yaml"
    shipped = ", ".join(sorted(p.stem for p in (ROOT / "configs").glob("*.yaml")))
    with pytest.raises(FileNotFoundError, match=f"shipped: {shipped}"):
        config_path("nope")
    # a flow's way in: a file or shipped name wins over the form's value, overrides are applied last
    cfg = load_spec("config", "tiny", {"diloco.learners": 2, "diloco.quorum": 1}, value=ExperimentConfig())
    assert cfg.name == "tiny" and cfg.diloco.learners == 2
    assert load_spec("config", value=cfg) is cfg


# -- 5. chaos that cannot happen is refused ------------------------------------------------------
def test_unreachable_chaos_step_is_refused():
    tiny = load_config(ROOT / "configs" / "tiny.yaml")
    assert tiny.learner_steps == 64
    with pytest.raises(ValidationError, match=r"chaos.events\[0\] \(fail\): at_step \(100000\) cannot happen.*≤ 64"):
        load_config(
            ROOT / "configs" / "tiny.yaml", {"chaos.events": [{"kind": "fail", "learner": 0, "at_step": 100000}]}
        )
    load_config(ROOT / "configs" / "tiny.yaml", {"chaos.events": [{"kind": "fail", "learner": 0, "at_step": 64}]})


# -- what a fresh user found next: the same kinds, more inputs ---------------------------------
def test_run_dir_inside_a_run_symlinks_proc_and_races(tmp_path):
    from run.directory import check_run_dir, claim_run_dir

    finished_run(tmp_path / "X")
    for inner in ("X/newsub", "X/a/b/c"):
        with pytest.raises(ValueError, match="is inside the run directory"):
            check_run_dir(tmp_path / inner)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="dangling symbolic link"):
        check_run_dir(tmp_path / "dangling")
    if Path("/proc/self").is_dir():
        with pytest.raises(ValueError, match="nothing can be created in /proc"):
            check_run_dir("/proc/ddiloco-run")
    with pytest.raises(ValueError, match="blank"):
        check_run_dir(" ")
    claim_run_dir(tmp_path / "race")  # the first run to start claims a new directory ...
    with pytest.raises(FileExistsError, match="just claimed by another run"):
        claim_run_dir(tmp_path / "race")  # ... and a second one started beside it is refused
    assert not list(tmp_path.glob(".ddiloco-probe-*"))


def test_reused_data_must_match_the_config(tmp_path, small_cfg, small_data):
    import shutil

    from flows.preflight import check_reusable_data
    from tests.conftest import SMALL_DATA

    shutil.copytree(small_data / "data", tmp_path / "R" / "data")
    check_reusable_data(tmp_path / "R", small_cfg.data, small_cfg.diloco.learners)  # the same data config: reused
    other = load_config(ROOT / "configs" / "tiny.yaml", {**SMALL_DATA, "data.vocab_size": 300})
    with pytest.raises(ValueError, match="holds data built from another data config"):
        check_reusable_data(tmp_path / "R", other.data, other.diloco.learners)
    with pytest.raises(ValueError, match="holds data built from another data config or learner count"):
        check_reusable_data(tmp_path / "R", small_cfg.data, 2)
    (tmp_path / "S" / "data").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds a data folder that cannot be reused"):
        check_reusable_data(tmp_path / "S", small_cfg.data, small_cfg.diloco.learners)


def test_goodput_never_writes_into_a_pipeline_run(tmp_path):
    finished_run(tmp_path / "X")
    line = one_line_refusal(*cli("goodput", "--out", tmp_path / "X"))
    assert "holds a pipeline run" in line


def test_more_corpus_faults_are_one_line(tmp_path):
    from configs.data import TextDataConfig
    from data.sources import read_local

    with pytest.raises(ValidationError, match="'rot13' is not a known text encoding"):
        TextDataConfig(source="local", paths=["a.txt"], encoding="rot13")
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"x.jsonl cannot be read as json"):
        read_local([str(tmp_path / "x.jsonl")])
    (tmp_path / "y.parquet").write_bytes(b"PAR1 not parquet")
    with pytest.raises(ValueError, match=r"y.parquet cannot be read as parquet"):
        read_local([str(tmp_path / "y.parquet")])
    (tmp_path / "z.jsonl").write_text('{"text": "nul \\u0000 inside"}\n')
    with pytest.raises(ValueError, match="NUL characters"):
        read_local([str(tmp_path / "z.jsonl")])
    with pytest.raises(ValueError, match="is a folder"):
        read_local([str(tmp_path)])


@pytest.mark.parametrize(
    "text, field, value",
    [
        ("diloco: {learners: 010, quorum: 2}", "diloco.learners", 10),  # YAML 1.1 read 8 (octal)
        ("diloco: {grace_s: 1:30}", "diloco.grace_s", None),  # YAML 1.1 read 90 (base 60): refused
        ("model: {tie_embeddings: yes}", "model.tie_embeddings", None),  # YAML 1.1 read true: refused
        ("train: {token_budget: 1_000_000}", "train.token_budget", 1_000_000),
    ],
)
def test_yaml_means_what_it_says(tmp_path, text, field, value):
    (tmp_path / "c.yaml").write_text(text + "\n")
    if value is None:
        with pytest.raises(ValidationError, match=field.split(".")[-1]):
            load_config(tmp_path / "c.yaml")
    else:
        section, name = field.split(".")
        assert getattr(getattr(load_config(tmp_path / "c.yaml"), section), name) == value


def test_duplicate_keys_and_chaos_events_are_refused(tmp_path):
    import yaml

    (tmp_path / "d.yaml").write_text("name: t\nname: u\n")
    with pytest.raises(yaml.YAMLError, match="'name' is given twice"):
        load_config(tmp_path / "d.yaml")
    with pytest.raises(ValidationError, match=r"chaos.events\[1\] \(fail\) hits learner 1 at step 3 again"):
        load_config(
            ROOT / "configs" / "tiny.yaml",
            {
                "chaos.events": [
                    {"kind": "fail", "learner": 1, "at_step": 3},
                    {"kind": "fail", "learner": 1, "at_step": 3},
                ]
            },
        )
    # two failures of one learner: the k-th fires on its k-th attempt (tests/test_learner.py)
    load_config(
        ROOT / "configs" / "tiny.yaml",
        {"chaos.events": [{"kind": "fail", "learner": 1, "at_step": 30}, {"kind": "fail", "learner": 1, "at_step": 3}]},
    )


def test_third_round_inputs(tmp_path):
    """Found by the second fresh-user round: links into a run, goodput --out inside a run or blank,
    a folder with only someone's config.json, odd YAML keys and scalars, seeds out of range."""
    import yaml

    from configs.load import yaml_value
    from run.directory import check_run_dir

    finished_run(tmp_path / "X")
    (tmp_path / "link").symlink_to(tmp_path / "X" / "pretrain")
    with pytest.raises(ValueError, match="is inside the run directory"):
        check_run_dir(tmp_path / "link" / "new")
    (tmp_path / "E").mkdir()
    (tmp_path / "E" / "config.json").write_text("{}")  # someone's own file, no data/ beside it
    with pytest.raises(ValueError, match=r"not empty \(config.json\)"):
        check_run_dir(tmp_path / "E")
    assert "inside the run directory" in one_line_refusal(*cli("goodput", "--out", tmp_path / "X" / "report" / "gp"))
    assert "blank" in one_line_refusal(*cli("goodput", "--out", ""))
    with pytest.raises(yaml.YAMLError, match="a key must be a plain name"):
        yaml_value("{[a]: 1}")
    assert [yaml_value(t) for t in (".", "0x_", "2001-12-14")] == [".", "0x_", "2001-12-14"]  # strings
    for overrides in ({"seed": 2**70}, {"data.seed": -1}):
        with pytest.raises(ValidationError, match="seed"):
            load_config(ROOT / "configs" / "tiny.yaml", overrides)
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe name: x")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        load_config(tmp_path / "bin.yaml")


# -- fine-tuning: every input checked before Prefect starts -------------------------------------
def test_finetune_inputs_are_refused_in_one_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"question": "a", "answer": "b"}\n')
    line = one_line_refusal(
        *cli(
            "run",
            "tiny",
            "--run-dir",
            tmp_path / "R1",
            "--set",
            "finetune.source=jsonl",
            "--set",
            f"finetune.paths=[{empty}]",
        )
    )
    assert "empty.jsonl holds no pairs" in line and not (tmp_path / "R1").exists()
    line = one_line_refusal(
        *cli(
            "run",
            "tiny",
            "--run-dir",
            tmp_path / "R2",
            "--set",
            "finetune.source=jsonl",
            "--set",
            f"finetune.paths=[{nofield}]",
        )
    )
    assert "no field 'prompt' (finetune.prompt_field)" in line and not (tmp_path / "R2").exists()
    line = one_line_refusal(*cli("validate", "tiny", "--set", "data.finetune_docs=0"))
    assert "data.finetune_docs" in line
    line = one_line_refusal(*cli("validate", "vit", "--set", "finetune.source=speakers"))
    assert "finetune.source speakers does not fit image data" in line
    line = one_line_refusal(*cli("finetune", tmp_path))
    assert "is not a run directory" in line
    finished_run(tmp_path / "F")
    line = one_line_refusal(*cli("finetune", tmp_path / "F", "--set", "diloco.learners=2"))
    assert "only finetune.* fields can change after pretraining" in line
    line = one_line_refusal(*cli("finetune", "--checkpoint", tmp_path / "nowhere"))
    assert "--checkpoint" in line and "is not a folder" in line


@pytest.mark.parametrize(
    "override, needle",
    [
        (
            "precision=bfloat16",
            "precision: is a section, not a value (got 'bfloat16'); set its keys: "
            "precision.params, precision.compute, precision.opt_state",
        ),
        (
            "precision.compute=float16",
            "precision.compute: Input should be 'float32' or 'bfloat16' (from --set precision.compute=float16)",
        ),
    ],
)
def test_a_bad_precision_policy_is_refused_in_one_line(tmp_path, override, needle):
    line = one_line_refusal(*cli("run", "tiny", "--run-dir", tmp_path / "R", "--set", override))
    assert needle in line
    assert not (tmp_path / "R").exists()


# -- image folders (issue 25, part 4) ------------------------------------------------------------
def test_an_image_folder_without_classes_is_refused_at_validate(tmp_path):
    """A flat folder of images (a notebook's checkpoints folder and a Mac zip's __MACOSX beside them are
    not classes) is refused by `ddiloco validate` in one line, naming the folder and the layout it needs
    (on the old code the two hidden folders counted as two classes and validate passed)."""
    from PIL import Image

    folder = tmp_path / "photos"
    for sub in ("", ".ipynb_checkpoints", "__MACOSX"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
        for i in range(30):
            Image.new("RGB", (8, 8), (i, 0, 0)).save(folder / sub / f"{i}.png")
    line = one_line_refusal(
        *cli(
            "validate",
            "vit",
            "--set",
            "data.source=imagefolder",
            "--set",
            f"data.paths=[{folder}]",
            "--set",
            "train.eval_batch_size=2",
        )
    )
    assert f"data.paths[0]: {folder} holds no class sub-folders" in line and "one sub-folder per class" in line


# -- issue 25, new-user round: a corpus too small to fill one sequence ------------------------------
def test_a_corpus_too_short_for_one_sequence_is_refused_at_validate(tmp_path):
    """Six one-line files: enough documents, far too few tokens for one sequence of data.seq_len + 1 in
    the held-out validation split (on the old code `validate` passed and the run failed in the data
    task with a traceback, exit 1)."""
    paths = corpus(tmp_path, [f"doc {i} is short" for i in range(6)])
    line = one_line_refusal(
        *cli(
            "validate",
            "tiny",
            "--set",
            "data.source=local",
            "--set",
            "data.finetune_docs=0",
            "--set",
            "finetune.enabled=false",
            "--set",
            f"data.paths=[{', '.join(paths)}]",
        )
    )
    assert (
        line.startswith("error: ")
        and (
            "the train split (the 2 document(s) not held out by data.val_docs, "
            "data.test_docs, data.finetune_docs) holds 28 bytes of text"
        )
        in line
    )
    assert "at most 30 tokens" in line and "data.seq_len + 1 = 33; lower data.seq_len, add text" in line
    # a long training split, a short validation split: the val split is named
    paths = corpus(tmp_path, [f"doc {i} is short" for i in range(4)] + ["a long play " * 40, "another " * 50])
    line = one_line_refusal(
        *cli(
            "validate",
            "tiny",
            "--set",
            "data.source=local",
            "--set",
            "data.finetune_docs=0",
            "--set",
            "finetune.enabled=false",
            "--set",
            f"data.paths=[{', '.join(paths)}]",
            "--set",
            "data.test_docs=1",
        )
    )
    assert "the val split (data.val_docs: 2 document(s)) holds 28 bytes of text" in line  # two short ones
    # long enough documents pass: every split can fill a sequence of 33 tokens
    paths = corpus(tmp_path, [f"doc {i} is long enough " * 4 for i in range(6)])
    code, err = cli(
        "validate",
        "tiny",
        "--set",
        "data.source=local",
        "--set",
        "data.finetune_docs=0",
        "--set",
        "finetune.enabled=false",
        "--set",
        f"data.paths=[{', '.join(paths)}]",
    )
    assert code == 0, err


def test_command_help_keeps_each_paragraph_on_its_lines(monkeypatch):
    """``ddiloco <command> --help``: a docstring paragraph is one paragraph of help, wrapped by the
    terminal only (typer 0.29 kept the source's line breaks, so "2 refused" and "before any work"
    landed on two lines)."""
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.setenv("COLUMNS", "200")
    for command, phrase in [("sweep", "2 refused before any work"), ("run", "2 refused before any work")]:
        out = CliRunner().invoke(app, [command, "--help"])
        assert out.exit_code == 0 and phrase in out.output, out.output


def test_version_and_a_quiet_validate():
    """``ddiloco --version`` names this package's version and the libraries' (from their metadata);
    ``validate --quiet`` prints the OK line alone, and a refusal is still one line with exit 2."""
    from importlib.metadata import version

    from typer.testing import CliRunner

    from flows.cli import app
    from tests.conftest import SMALL_CORPUS

    out = CliRunner().invoke(app, ["--version"])
    assert out.exit_code == 0 and out.output.startswith(f"ddiloco {version('decoupled-diloco-pipeline')} (jax ")
    assert f"prefect {version('prefect')}" in out.output
    local = ["--set", "data.source=local", "--set", f"data.paths=[{SMALL_CORPUS}]"]  # offline
    out = CliRunner().invoke(app, ["validate", "tiny", "--quiet", *local])
    assert out.exit_code == 0 and out.output.splitlines() == [
        "OK: tiny: 64 DP steps of 384 tokens; 3 learners × 128 tokens per step"
    ], out.output
    out = CliRunner().invoke(app, ["validate", "tiny", "-q", *local, "--set", "diloco.quorum=9"])
    assert out.exit_code == 2 and "diloco.quorum" in out.output and "OK:" not in out.output
