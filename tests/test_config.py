"""Config validation: bad input fails before any work, naming the field."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from configs.load import load_config
from configs.schema import ExperimentConfig, validate_against_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_build(path):
    from flows.pipeline import preflight

    cfg = load_config(path)
    # builds the model and checks P against its tensors; the corpus itself is not read here: every
    # shipped config trains on an embedded dataset: the default corpus, which the one test on the real
    # download (tests/test_flows.py::test_pipeline_end_to_end) checks and prepares through the same
    # preflight, or scikit-learn's digits (tests/test_families.py)
    assert cfg.data.source in ("shakespeare", "digits")
    assert (cfg.data.source == "digits") == (cfg.model.kind in ("vit", "vit_moe"))
    assert preflight(cfg, check_data=False) is not None
    assert path.read_text().startswith("# Run:")


def test_default_config_meets_the_brief():
    from models import InputShape, build_model, count_params

    cfg = load_config(ROOT / "configs" / "default.yaml")
    assert cfg.diloco.learners == 4
    assert cfg.dp_steps * cfg.tokens_per_dp_step >= 2_000_000
    spec = build_model(cfg.model, InputShape(vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len))
    assert spec.params >= 1_000_000
    assert count_params(spec.init(0)) == spec.params


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"diloco": {"learners": 2, "quorum": 3}}, "diloco.quorum"),
        ({"diloco": {"inner": {"lr": 0}}}, "diloco.inner.lr"),
        ({"dp": {"inner": {"lr": -1e-3}}}, "dp.inner.lr"),
        ({"diloco": {"outer_lr": 0}}, "diloco.outer_lr"),
        ({"train": {"token_budget": 0}}, "train.token_budget"),
        ({"data": {"source": "gopher"}}, "data.source"),
        ({"model": {"kind": "rnn"}}, "model.kind"),
        ({"model": {"d_model": 100, "n_heads": 3}}, "model.d_model"),
        ({"diloco": {"learnres": 4}}, "diloco.learnres"),
        ({"chaos": {"events": [{"kind": "fail", "learner": 9, "at_step": 3}]}}, "chaos.events[0] (fail): learner"),
        # the earlier fault keys are refused with the new spelling
        ({"chaos": {"failures": [{"learner": 1, "at_step": 3}]}}, "chaos.failures is now written as chaos.events"),
        ({"chaos": {"events": [{"kind": "explode", "learner": 1}]}}, "chaos.events.0"),
        ({"data": {"source": "local"}}, "data.paths"),
        ({"train": {"microbatch_size": 3}}, "train.microbatch_size"),
        # one receipt rule by name (the old keep_in_flight / mix_alpha pair is gone)
        ({"diloco": {"receipt": "average"}}, "diloco.receipt"),
        ({"diloco": {"keep_in_flight": True}}, "diloco.keep_in_flight"),
        ({"diloco": {"receipt": "mix", "mix_alpha": 1.0}}, "diloco.mix_alpha"),
        ({"dp": {"batch_size": 6}, "train": {"microbatch_size": 4}}, "dp.batch_size"),
        ({"runtime": {"engine": "processes"}}, "runtime.engine"),
        ({"runtime": {"max_workers": 2}}, "runtime.max_workers"),
        ({"diloco": {"compute_slots": -1}}, "diloco.compute_slots"),
        ({"diloco": {"syncer_checkpoint_every_s": -1}}, "diloco.syncer_checkpoint_every_s"),
        # a syncer failure needs a restartable syncer (fsspec), increasing merges, enough retries
        ({"chaos": {"events": [{"kind": "syncer_fail", "at_merge": 3}]}}, "runtime.exchange fsspec"),
        (
            {
                "runtime": {"exchange": "fsspec"},
                "chaos": {"events": [{"kind": "syncer_fail", "at_merge": 3}, {"kind": "syncer_fail", "at_merge": 3}]},
            },
            "chaos.events syncer_fail at_merge",
        ),
        (
            {
                "runtime": {"exchange": "fsspec"},
                "diloco": {"syncer_retries": 0},
                "chaos": {"events": [{"kind": "syncer_fail", "at_merge": 3}]},
            },
            "diloco.syncer_retries",
        ),
        (
            {
                "runtime": {"exchange": "fsspec"},
                "chaos": {"events": [{"kind": "syncer_fail", "at_merge": 3, "when": "later"}]},
            },
            "chaos.events.0.syncer_fail.when",
        ),
        # a DP job of several hosts: each host a replica, an equal share of every step's rows
        ({"dp": {"hosts": 2, "workers": 4}}, "dp.workers (4) must equal dp.hosts (2)"),
        ({"dp": {"hosts": 3, "workers": 3, "batch_size": 32}}, "dp.batch_size (32) must be divisible by dp.hosts"),
        ({"dp": {"hosts": 2, "workers": 2}, "train": {"microbatch_size": 3}}, "train.microbatch_size"),
        ({"dp": {"hosts": 0}}, "dp.hosts"),
        # a DP host's failure: an existing host, a SIGKILL only where hosts are processes of their own
        ({"chaos": {"events": [{"kind": "dp_fail", "host": 1, "at_step": 3}]}}, "host (1) must be < dp.hosts (1)"),
        (
            {"chaos": {"events": [{"kind": "dp_fail", "at_step": 3, "how": "sigkill"}]}},
            "how sigkill with dp.hosts 1 would kill the whole run",
        ),
        ({"chaos": {"events": [{"kind": "dp_fail", "at_step": 3, "at_s": 1.0}]}}, "exactly one of at_step and at_s"),
        (
            {"dp": {"enabled": False}, "chaos": {"events": [{"kind": "dp_fail", "at_step": 3}]}},
            "dp.enabled is false",
        ),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValidationError) as info:
        ExperimentConfig.model_validate(overrides)
    text = str(info.value)
    assert field.split(".")[-1].split("[")[0] in text, text
    assert field in text or " " not in field, text  # a phrase of the message is there as written


def test_a_run_from_before_chaos_events_still_loads():
    """The config.json of an earlier run holds the old fault keys empty: they carry nothing and load."""
    old = {"chaos": {"failures": [], "slowdowns": [], "kills": [], "syncer_failures": [], "against_dp": False}}
    assert ExperimentConfig.model_validate(old).chaos.events == []


def test_too_many_fragments_for_the_model():
    cfg = ExperimentConfig.model_validate({"diloco": {"fragments": 500}})
    with pytest.raises(ValueError, match="diloco.fragments"):
        validate_against_model(cfg.diloco, n_tensors=20)


@pytest.mark.process
@pytest.mark.slow
def test_cli_rejects_bad_config_before_work(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("diloco: {learners: 2, quorum: 4}\n")
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "validate", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert "diloco.quorum" in out.stderr
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "validate",
            str(ROOT / "configs/default.yaml"),
            "--set",
            "diloco.fragments=99",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "diloco.fragments" in out.stderr
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "validate",
            str(ROOT / "configs/tiny.yaml"),
            "--set",
            "data.source=local",
            "--set",
            "data.paths=[/nonexistent.txt]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "data.paths: file not found: /nonexistent.txt" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "report", str(tmp_path / "no-such-run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "no-such-run" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "no-such-run").exists()
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: [1\n")
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "validate", str(broken)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "not valid YAML" in out.stderr and "Traceback" not in out.stderr
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "goodput", "--out", str(a_file)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "not a directory" in out.stderr and "Traceback" not in out.stderr


def test_overrides_parse_as_yaml_and_errors_read_as_one_line_per_field():
    from pydantic import ValidationError

    from configs.load import parse_overrides, validation_lines
    from configs.schema import ExperimentConfig

    assert parse_overrides(["diloco.learners=2", "data.paths=[a.txt, b.txt]", "eval.enabled=false"]) == {
        "diloco.learners": 2,
        "data.paths": ["a.txt", "b.txt"],
        "eval.enabled": False,
    }
    with pytest.raises(ValueError, match="key=value.*'learners'"):
        parse_overrides(["learners"])
    with pytest.raises(ValidationError) as exc:
        ExperimentConfig.model_validate({"diloco": {"learners": 2, "quorum": 3}, "train": {"token_budget": 0}})
    lines = validation_lines(exc.value)
    assert any(line.startswith("train.token_budget: ") for line in lines)
    assert any(line.startswith("diloco.quorum (K=3)") for line in lines)  # named once, not twice
    assert not any("Value error" in line for line in lines)
    with pytest.raises(ValidationError) as exc:
        ExperimentConfig.model_validate({"diloco": {"lerners": 2}})
    (line,) = validation_lines(exc.value)
    assert line.startswith("diloco.lerners: ") and "valid keys here: enabled, learners, fragments" in line
    assert "; did you mean diloco.learners? (" in line  # the closest key, named


def test_override_below_a_single_value_is_refused(tmp_path):
    from configs.load import load_config

    with pytest.raises(ValueError, match=r"diloco.learners is a single value, not a section; set it directly"):
        load_config(ROOT / "configs" / "tiny.yaml", {"diloco.learners.x": 1})


def test_scripts_get_one_error_line_for_any_bad_config(tmp_path):
    from configs.specs import load_spec

    with pytest.raises(ValueError, match="config file not found"):
        load_spec("config", tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {microbatch_size: 3}\n")
    with pytest.raises(ValueError, match=r"invalid config .*train.microbatch_size \(3\) must divide"):
        load_spec("config", bad)
    bad.write_text("train: [\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        load_spec("config", bad)


def test_slowdowns_are_checked():
    base = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml").model_dump()
    ok = ExperimentConfig.model_validate(
        {**base, "chaos": {"events": [{"kind": "slowdown", "learner": 1, "factor": 1.18}]}}
    )
    assert ok.chaos.events[0].to_s is None and ok.chaos.events[0].from_s == 0.0
    bad = [
        ({"learner": 9, "factor": 1.18}, r"chaos.events\[0\] \(slowdown\): learner \(9\) must be < diloco.learners"),
        ({"learner": 0, "factor": 0.9}, "greater than 1"),
        ({"learner": 0, "factor": 2, "from_s": 5, "to_s": 5}, r"ends \(to_s 5\) before it begins"),
    ]
    for spec, message in bad:
        with pytest.raises(ValidationError, match=message):
            ExperimentConfig.model_validate({**base, "chaos": {"events": [{"kind": "slowdown", **spec}]}})


def test_validation_lines_show_the_value_and_name_the_set_that_gave_it():
    """A refusal shows the value that was refused and, for a field given on the command line, the
    ``--set`` item (the file is not to blame); a file's own values are shown as given."""
    from pydantic import ValidationError

    from configs.load import validation_lines
    from configs.schema import ExperimentConfig

    overrides = {"diloco.learners": 0, "nosuch.field": 1}
    data = {"diloco": {"learners": 0}, "nosuch": {"field": 1}, "train": {"token_budget": -5}}
    with pytest.raises(ValidationError) as info:
        ExperimentConfig.model_validate(data)
    lines = sorted(validation_lines(info.value, overrides))
    # a range error says what the number means, from the field's description
    assert lines[0].startswith("diloco.learners: Input should be greater than 0 (")
    assert lines[0].endswith(") (from --set diloco.learners=0)")
    assert lines[1].startswith("nosuch: Extra inputs are not permitted (valid keys here: name, seed")
    assert lines[1].endswith("(from --set nosuch.field=1)")
    assert lines[2].startswith("train.token_budget: Input should be greater than 0 (got -5) (")


def test_a_refusal_names_the_way_out_and_every_set_that_led_to_it():
    """A bandwidth of 0 is refused with what null means (no network), and a cross-field refusal is
    traced to each ``--set`` whose field it names, not only the first."""
    from pydantic import ValidationError

    from configs.load import load_config, validation_lines

    overrides = {"network.bandwidth_gbps": 0}
    with pytest.raises(ValidationError) as info:
        load_config("configs/tiny.yaml", overrides)
    (line,) = validation_lines(info.value, overrides)
    assert line.startswith("network.bandwidth_gbps: Input should be greater than 0 (")
    assert "null = every worker on this host" in line and line.endswith("(from --set network.bandwidth_gbps=0)")
    overrides = {"network.emulate": True, "runtime.engine": "dask", "dp.hosts": 3}
    with pytest.raises(ValidationError) as info:
        load_config("configs/tiny.yaml", overrides)
    (line,) = validation_lines(info.value, overrides)
    assert line.startswith("network.emulate starts each learner") and "set runtime.engine threads" in line
    assert line.endswith("(from --set network.emulate=true, --set runtime.engine=dask)")


# -- issue 25, new-user round: overrides, retries, sweeps ---------------------------------------
@pytest.mark.parametrize("kind", ["fail", "kill"])
def test_more_explicit_chaos_faults_than_retries_are_refused_without_a_schedule(kind):
    """Faults beyond diloco.learner_retries (2) and no chaos.schedule: one learner lost for good is a
    scenario (the others spend the budget); every learner lost is refused (the run could not finish;
    on the old code the count was skipped when no schedule was drawn)."""
    engine = {"runtime.engine": "dask" if kind == "kill" else "threads"}
    lost = [{"kind": kind, "learner": 0, "at_step": s} for s in (3, 5, 7, 9)]
    assert len(load_config(ROOT / "configs" / "tiny.yaml", {"chaos.events": lost, **engine}).chaos.events) == 4
    every = [{"kind": kind, "learner": m, "at_step": s} for m in range(3) for s in (3, 5, 7, *((9,) if m == 1 else ()))]
    with pytest.raises(
        ValidationError,
        match=r"fails every learner more often than diloco.learner_retries \(2; the "
        r"least, learner 0, 3 times\).*≥ 3",
    ):
        load_config(ROOT / "configs" / "tiny.yaml", {"chaos.events": every, **engine})
    load_config(ROOT / "configs" / "tiny.yaml", {"chaos.events": every, **engine, "diloco.learner_retries": 3})


def test_a_key_set_twice_on_one_command_line_is_refused():
    from configs.load import parse_overrides

    with pytest.raises(ValueError, match=r"--set diloco.learners is given twice \(2, then 3\)"):
        parse_overrides(["diloco.learners=2", "diloco.learners=3"])
    assert parse_overrides(["diloco.learners=2", "diloco.quorum=1"]) == {"diloco.learners": 2, "diloco.quorum": 1}


def test_a_section_valued_override_merges_into_the_section(tmp_path):
    """`--set 'diloco={learners: 4}'` changes learners only; tiny's other diloco values stay (on the old
    code the section was replaced and sync_every fell back to the schema's 32). The same for a sweep
    axis whose values are sections."""
    from configs.load import parse_overrides
    from configs.sweep import SweepSpec, cell_config, expand_cells

    tiny = load_config(ROOT / "configs" / "tiny.yaml")
    cfg = load_config(ROOT / "configs" / "tiny.yaml", parse_overrides(["diloco={learners: 4, quorum: 3}"]))
    assert (cfg.diloco.learners, cfg.diloco.quorum) == (4, 3)
    assert cfg.diloco.sync_every == tiny.diloco.sync_every == 4
    assert cfg.diloco.batch_size == tiny.diloco.batch_size and cfg.model == tiny.model
    spec = SweepSpec(base="tiny", grid={"diloco": [{"learners": 2, "quorum": 1}, {"learners": 4}]})
    for cell in expand_cells(spec):
        got = cell_config(spec, cell)
        assert got.diloco.sync_every == 4 and got.diloco.outer_lr == tiny.diloco.outer_lr
    assert (
        load_config(ROOT / "configs" / "tiny.yaml", {"chaos.events": [{"kind": "fail", "learner": 0, "at_step": 3}]})
        .chaos.events[0]
        .at_step
        == 3
    )  # lists are values: replaced, not merged
    # a section naming another model family replaces the section (moe's expert fields would not fit)
    dense = load_config(ROOT / "configs" / "moe.yaml", parse_overrides(["model={kind: dense_lm, d_model: 32}"]))
    assert dense.model.kind == "dense_lm" and dense.model.d_model == 32
    same = load_config(ROOT / "configs" / "moe.yaml", parse_overrides(["model={kind: moe_lm, n_experts: 2}"]))
    assert same.model.n_experts == 2 and same.model.d_model == load_config(ROOT / "configs" / "moe.yaml").model.d_model


def test_one_loader_for_configs_sweeps_and_studies(tmp_path):
    """configs.specs.load_spec, what every command loads through: a file or a shipped name, then what
    the command line adds, validated once; a refusal (a missing file too) is one ValueError line that
    names the option which gave the field."""
    from configs.specs import load_spec, read_base
    from configs.tune import TuneSpec

    cfg = load_spec("config", "tiny", ["diloco.learners=2", "diloco.quorum=1"])
    assert (cfg.name, cfg.diloco.learners) == ("tiny", 2)
    with pytest.raises(ValueError, match=r"^config file not found: nope \(neither a file nor a shipped config"):
        load_spec("config", "nope")
    with pytest.raises(
        ValueError, match=r"^invalid config tiny: diloco.learners: .* \(from --set diloco.learners=0\)$"
    ):
        load_spec("config", "tiny", {"diloco.learners": 0})
    # a sweep file without a grid takes it from --axis: the file and the additions are validated together
    (tmp_path / "s.yaml").write_text("base: tiny\noverrides: {finetune.enabled: false}\n")
    s = load_spec(
        "sweep",
        tmp_path / "s.yaml",
        ["train.token_budget=12288"],
        axes=["diloco.learners=[2,3]"],
        fields={"name": None},
    )
    assert s.grid == {"diloco.learners": [2, 3]} and s.overrides == {
        "finetune.enabled": False,
        "train.token_budget": 12288,
    }
    with pytest.raises(ValueError, match=r"^invalid sweep .*s.yaml: concurrency: .* \(from --concurrency 0\)$"):
        load_spec("sweep", tmp_path / "s.yaml", axes=["diloco.learners=[2]"], fields={"concurrency": 0})
    with pytest.raises(
        ValueError, match=r"^tiny is an experiment config, not a sweep file; sweep over it with --base tiny"
    ):
        load_spec("sweep", "tiny")
    with pytest.raises(ValueError, match="configs/tiny.yaml is an experiment config, not a study file"):
        load_spec("study", "configs/tiny.yaml")
    study = load_spec("study", "tune_tiny", fields={"compare": False, "trials": 3})
    assert isinstance(study, TuneSpec) and (study.trials, study.compare) == (3, False)
    assert load_spec("study", value=study) is study  # a flow's validated spec passes as it is
    (tmp_path / "bad.yaml").write_text("data: [1\n")  # a study's base: refused in one line, not a traceback
    with pytest.raises(ValueError, match=r"^study x, base: .*bad.yaml is not valid YAML: "):
        read_base(str(tmp_path / "bad.yaml"), "study x")


def test_an_unknown_sweep_key_lists_the_valid_keys(tmp_path):
    from configs.specs import load_spec

    (tmp_path / "s.yaml").write_text("base: tiny\nconcurency: 2\ngrid: {diloco.learners: [2, 3]}\n")
    with pytest.raises(ValueError) as exc:  # one line, as the CLI prints it
        load_spec("sweep", tmp_path / "s.yaml")
    line = str(exc.value)
    assert line.startswith(f"invalid sweep {tmp_path / 's.yaml'}: concurency: ")
    assert (
        "concurency: Extra inputs are not permitted; did you mean concurrency? (valid keys here: name, base, "
        "overrides, grid, cells, seeds, concurrency" in line
    )


def test_validate_prints_every_derived_value():
    """The values derived from a config (microbatches, steps, units) are computed once, by
    ExperimentConfig.derived, and `ddiloco validate` prints each of them."""
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, ["validate", "tiny", "--set", "train.microbatch_size=2"])
    assert result.exit_code == 0, result.output
    cfg = load_config(ROOT / "configs" / "tiny.yaml", {"train.microbatch_size": 2})
    derived = cfg.derived()
    assert derived["learner_microbatches"] == cfg.diloco.batch_size // 2 > 1
    assert derived["dp_microbatches"] == cfg.dp.batch_size // 2
    assert derived["learner_steps"] * cfg.diloco.learners * derived["tokens_per_learner_step"] >= cfg.train.token_budget
    for key, value in derived.items():
        assert f"  {key}: {value}\n" in result.output, key


def test_every_field_has_a_readable_title_for_the_ui_form():
    """The Prefect UI's form shows each field's JSON-schema title: spelled out, with its unit."""
    defs = ExperimentConfig.model_json_schema()["$defs"]
    titles = {name: {k: v.get("title") for k, v in d.get("properties", {}).items()} for name, d in defs.items()}
    assert titles["DiLoCoConfig"]["outer_lr"] == "Outer learning rate"
    assert titles["DiLoCoConfig"]["heartbeat_timeout_s"] == "Heartbeat timeout (s)"
    assert titles["RuntimeConfig"]["exchange_url"] == "Exchange URL"
    assert titles["ChaosPlan"]["mtbf_s"] == "MTBF (s)"
    assert titles["FailEvent"]["restart_delay_s"] == "Restart delay (s)"
    assert all(t and t[0].isupper() and "_" not in t for d in titles.values() for t in d.values()), titles


def test_text_and_image_data_are_two_members_of_one_union():
    """data.source picks the member: each has only its own fields, a field of the other modality is
    refused naming it (left at its old default, as a run's config.json from before the union holds
    it, it is dropped), an unknown source names all six, and errors name data.<field>."""
    from configs.data import ImageDataConfig, TextDataConfig
    from configs.load import validation_lines

    vit = load_config(ROOT / "configs" / "vit.yaml")
    assert isinstance(vit.data, ImageDataConfig) and "seq_len" not in vit.data.model_dump()
    assert isinstance(load_config(ROOT / "configs" / "tiny.yaml").data, TextDataConfig)
    with pytest.raises(ValidationError, match="data.seq_len applies to text sources, not data.source: digits"):
        ExperimentConfig.model_validate({"data": {"source": "digits", "seq_len": 64}, "model": {"kind": "vit"}})
    old_dump = {**TextDataConfig().model_dump(), "image_column": "image", "val_fraction": 0.1, "channels": None}
    assert ExperimentConfig.model_validate({"data": old_dump}).data == TextDataConfig()
    for data, line in (
        ({"source": "gopher"}, "data.source: 'gopher' is unknown; choose one of shakespeare, local, hf, digits, "),
        ({"source": "local"}, "data.paths must list at least one file"),
        (
            {"source": "digits", "image_colum": "x"},
            "data.image_colum: Extra inputs are not permitted; did you mean data.image_column? (valid keys here",
        ),
    ):
        with pytest.raises(ValidationError) as info:
            ExperimentConfig.model_validate({"data": data, "model": {"kind": "vit"}})
        lines = validation_lines(info.value)
        assert len(lines) == 1 and lines[0].startswith(line), lines


def test_chaos_event_refusals_name_the_event_its_field_and_the_set_that_gave_it():
    """An unknown or missing kind names the six; a misspelt field lists the event's keys; a
    cross-field refusal names the event and, like every other refusal, the --set item."""
    from configs.load import validation_lines

    cases = [
        ([{"kind": "explode", "learner": 1}], "chaos.events[0].kind: 'explode' is unknown; choose one of fail, kill, "),
        ([{"learner": 1}], "chaos.events[0].kind: is missing; choose one of fail, kill, slowdown, corrupt, presence"),
        (
            [{"kind": "fail", "learner": 1, "at_stp": 3}],
            "chaos.events[0].at_stp: Extra inputs are not permitted; did you mean chaos.events[0].at_step? "
            "(valid keys here: kind, learner, at_step, at_s,",
        ),
        (
            [{"kind": "fail", "learner": 7, "at_step": 3}],
            "chaos.events[0] (fail): learner (7) must be < diloco.learners (3): learners are numbered 0 to 2",
        ),
    ]
    for events, start in cases:
        overrides = {"chaos.events": events}
        with pytest.raises(ValidationError) as info:
            load_config(ROOT / "configs" / "tiny.yaml", overrides)
        lines = validation_lines(info.value, overrides)
        assert len(lines) == 1 and lines[0].startswith(start), lines
        # the value as YAML, as it is written after --set (not Python's repr)
        shown = yaml.safe_dump(events, default_flow_style=True, sort_keys=False).strip()
        assert lines[0].endswith(f"(from --set chaos.events={shown})") and "'" not in shown, lines


def test_a_runs_stored_config_reads_back_typed_with_the_earlier_fault_keys_as_events():
    """A run's config.json read back (configs.load.stored_config, what reports read): the fault keys of
    the earlier languages become the events they were, a reference run need not exist on this machine,
    and ``model_fields_set`` tells a section the file did not write (a run from before it); the same
    mapping given as a new config is refused naming the new spelling. reports.common.settings is None
    for no file or one this schema refuses."""
    from configs.load import stored_config
    from reports.common import settings

    old = {
        "diloco": {"learners": 2, "quorum": 1},
        "runtime": {"engine": "dask"},
        "chaos": {
            "failures": [{"learner": 1, "at_step": 3}],
            "kills": [{"learner": 0, "at_s": 2.0}],
            "slowdowns": [],
            "reference_run": "/nowhere/run",
        },
    }
    cfg = stored_config(old)
    assert [(e.kind, e.learner) for e in cfg.chaos.events] == [("fail", 1), ("kill", 0)]
    assert cfg.chaos.reference_run == "/nowhere/run" and "network" not in cfg.model_fields_set
    with pytest.raises(ValidationError, match="chaos.failures is now written as chaos.events"):
        ExperimentConfig.model_validate(old)
    assert settings(None) is None and settings({"diloco": {"learners": 0}}) is None
    assert settings(old).chaos.events == cfg.chaos.events
