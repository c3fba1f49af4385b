"""Command line: ``ddiloco run CONFIG`` runs the pipeline flow and prints where the report is."""

from __future__ import annotations

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# lm-eval and datasets draw progress bars per task and request type: noise in a run's log. tqdm reads
# this when it is first imported, so here (TQDM_DISABLE=0 in the environment brings them back).
os.environ.setdefault("TQDM_DISABLE", "1")

import inspect
import json
from pathlib import Path

import typer
from pydantic import ValidationError

from run.layout import GoodputLayout, RunLayout, StudyLayout, SweepLayout

SET_HELP = (
    "override a field, e.g. --set diloco.learners=2 (the value is YAML; a section's mapping, e.g. --set "
    "'diloco={learners: 4}', merges into that section; each key once)"
)
app = typer.Typer(add_completion=False, help="Decoupled DiLoCo vs data-parallel pretraining pipeline.")


def _version(value: bool) -> None:
    """``--version``: this package's and its main libraries' versions, from their installed metadata."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in ("decoupled-diloco-pipeline", "jax", "flax", "optax", "orbax-checkpoint", "prefect", "lm-eval"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = "not installed"
    libs = ", ".join(f"{d} {v}" for d, v in list(found.items())[1:])
    typer.echo(f"ddiloco {found['decoupled-diloco-pipeline']} ({libs})")
    raise typer.Exit(0)


@app.callback()
def _main(
    show_version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the versions and exit"
    ),
) -> None:
    """Decoupled DiLoCo vs data-parallel pretraining pipeline."""


def _shipped(folder: str) -> str:
    """The shipped configs, sweeps or studies (``configs/<folder>/*.yaml``) without importing pydantic."""
    return ", ".join(sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs" / folder).glob("*.yaml")))


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _refused(check, *args, where: str = "", **kwargs):
    """``check(*args, **kwargs)``, its one-line refusal (``ValueError``/``OSError``) printed, exit 2."""
    try:
        return check(*args, **kwargs)
    except (ValueError, OSError) as exc:
        raise _fail(f"{where}{exc}")


def _load(kind: str, source: str | None, **given):
    """:func:`configs.specs.load_spec` (imported here: ``--help`` stays fast), refused in one line."""
    from configs.specs import load_spec

    return _refused(load_spec, kind, source, **given)


def _preflight(check: str, *args, where: str = "", **kwargs):
    """``flows.preflight.<check>(*args, **kwargs)``, refused in one line. Prefect's logging is set up first: Orbax's
    import gives absl's bare handler to the root logger, after which Prefect's format would be lost."""
    from prefect.logging.configuration import setup_logging

    setup_logging()
    from flows import preflight

    return _refused(getattr(preflight, check), *args, where=where, **kwargs)


def _checked(config: str, sets: list[str], run_dir: str | None = None):
    """The config with its ``--set`` items and every check of a run, before Prefect starts: (cfg, run dir)."""
    cfg = _load("config", config, sets=sets)
    from flows.engines import share_accelerators

    share_accelerators(cfg.runtime)  # before the checks start JAX (they ask for its devices)
    return cfg, _preflight("preflight", cfg, run_dir, where=f"{config}: ")


def _check_out(out: str, goodput: bool = False) -> Path:
    """``--out``: a new or empty folder by the run directory's rules (``run.directory.check_run_dir``;
    goodput's may also hold other files, never a goodput or pipeline run), else exit 2."""
    from run.directory import check_run_dir

    path, problem = Path(out).expanduser().absolute(), None
    if not out.strip():
        problem = "is blank; give a folder name"
    elif goodput and GoodputLayout(path).result.exists():
        problem = "already holds a goodput run (goodput.json); choose another directory"
    elif goodput and (RunLayout(path).status.exists() or (path / "pretrain").exists()):
        problem = "holds a pipeline run, which is never written into; choose another directory"
    elif path.is_dir() and any(path.iterdir()):
        if not goodput:
            problem = "exists and is not empty; choose a new or empty folder (a comparison never writes over files)"
        elif not os.access(path, os.W_OK | os.X_OK):
            problem = "is not a writable directory"
    else:
        try:
            check_run_dir(path)
        except ValueError as exc:
            problem = str(exc).replace("--run-dir", "--out")
    if problem:
        raise _fail(f"--out {out}: {problem}")
    return path


def _run_flow(start, report: Path | None = None, label: str = "Report"):
    """``start()`` (a flow's call) on Prefect's temporary server, SIGINT/SIGTERM stopping it gracefully:
    exit 128 + the signal when stopped, 1 when failed (naming ``report`` if written) or on an error."""
    from prefect.exceptions import CancelledRun, FailedRun

    from flows.server import start_temporary_server
    from run.control import graceful_stop, stop_signal

    try:
        with graceful_stop():  # also while Prefect's temporary server starts and stops
            start_temporary_server()
            return start()
    except CancelledRun as exc:
        typer.echo(f"\ninterrupted: {exc}", err=True)
        raise typer.Exit(128 + (stop_signal() or 15))
    except FailedRun as exc:
        shown = f"\n{label}: {report}" if report is not None and report.is_file() else ""
        typer.echo(f"\nfailed: {exc}{shown}", err=True)
        raise typer.Exit(1)
    except (OSError, ValueError, RuntimeError) as exc:
        typer.echo(f"\nerror: {exc}", err=True)
        raise typer.Exit(1)


@app.command()
def run(
    config: str = typer.Argument(
        "configs/default.yaml", help=f"YAML experiment config, or a shipped config's name: {_shipped('.')}"
    ),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    run_dir: str | None = typer.Option(None, help="run directory, new or empty (default: <run_root>/<name>-<time>)"),
):
    """Shard → DiLoCo and DP pretraining → lm-eval → fine-tuning → report, as one Prefect flow run.

    Exit status: 0 done; 1 the run failed (the reason is the last line); 2 refused before any
    work; 130/143 stopped by SIGINT/SIGTERM (the run directory's status.json says what completed).
    """
    cfg, rd = _checked(config, set_, run_dir)
    from flows.pipeline import pipeline
    from flows.terminal import progress_display

    def start() -> str:
        with progress_display():  # a bar per method, in a terminal only
            return pipeline(config=cfg, run_dir=str(rd))

    out = _run_flow(start, RunLayout(rd).report_md)
    _print_verdict(Path(out))
    report = Path(out) / "report"
    typer.echo(f"\nReport: {report / 'report.md'} (as one file to share: {report / 'report.html'})")
    if cfg.tracking.tensorboard:
        typer.echo(f"Curves: .venv/bin/tensorboard --logdir {out}")


def _print_verdict(rd: Path) -> None:
    """The report's verdict (``report.json``) as a table and a paragraph, if the run has one."""
    from reports.verdict import verdict_table

    try:
        v = json.loads(RunLayout(rd).report_json.read_text()).get("verdict")
    except (OSError, ValueError):
        return
    if v:
        typer.echo("\n" + verdict_table(v, "simple") + "\n\n" + v["words"])


@app.command()
def finetune(
    run_dir: str | None = typer.Argument(None, help="a run directory made by `ddiloco run`"),
    methods: str | None = typer.Option(
        None, help="pretrained methods to fine-tune, comma-separated (default: every one with a checkpoint)"
    ),
    checkpoint: str | None = typer.Option(
        None, help="instead, an Orbax checkpoint folder of ours, e.g. RUN/pretrain/dp/checkpoints"
    ),
    name: str | None = typer.Option(None, help="method name for --checkpoint's results (default <method>-ckpt)"),
    set_: list[str] = typer.Option(
        [], "--set", help="change the recipe, e.g. --set finetune.mode=lora --set finetune.seeds=[0,1,2]"
    ),
    replace: bool = typer.Option(False, help="delete these methods' earlier fine-tuning results first"),
):
    """Fine-tune a run's pretrained models with one recipe, evaluate before and after, rebuild the report.

    Exit status: 0 done; 1 failed; 2 refused before any work; 130/143 stopped by a signal.
    """
    from configs.load import parse_overrides

    chosen = [m.strip() for m in methods.split(",") if m.strip()] if methods else None
    given = {"methods": chosen, "checkpoint": checkpoint, "name": name, "replace": replace}
    given["overrides"] = _refused(parse_overrides, set_)
    plan = _preflight("finetune_preflight", run_dir, **given)
    from flows.finetune import finetune as finetune_flow

    rd = str(plan["run_dir"])
    out = _run_flow(lambda: finetune_flow(run_dir=rd, **given), RunLayout(rd).report_md)
    typer.echo(f"\nReport: {RunLayout(out).report_md}")


@app.command()
def validate(
    config: str = typer.Argument(..., help="YAML experiment config, or a shipped config's name"),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print only the last line (OK: …)"),
):
    """Check a config (the model it builds and its corpus) without running anything: prints the
    config with every default filled in, the values derived from it, and one OK line.

    Exit status: 0 valid; 2 refused (one line naming the field or file)."""
    cfg, _ = _checked(config, set_)
    if not quiet:
        typer.echo(json.dumps(cfg.model_dump(mode="json"), indent=2))
        typer.echo("derived (computed once from the fields above, configs.schema.ExperimentConfig.derived):")
        for key, value in cfg.derived().items():
            typer.echo(f"  {key}: {value}")
    typer.echo(
        f"OK: {config}: {cfg.dp_steps} DP steps of {cfg.tokens_per_dp_step} {cfg.unit}; "
        f"{cfg.diloco.learners} learners × {cfg.tokens_per_learner_step} {cfg.unit} per step"
    )


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="a finished run directory"),
    reference: Path | None = typer.Option(
        None,
        help="a run directory of the same experiment without chaos: the Resilience section puts its held-out "
        "loss at equal time and tokens beside this run's (default: the run's chaos.reference_run)",
    ),
):
    """Rebuild report/ from a run directory's files (with the goodput simulator's prediction when the
    run has a chaos schedule)."""
    from run.directory import readable_run

    _refused(readable_run, run_dir)  # before the report's libraries load (seconds)
    from reports import build_report
    from sim.study import simulate_goodput

    _refused(build_report, run_dir, reference=reference, predict=simulate_goodput)
    typer.echo(f"Report: {RunLayout(run_dir).report_md}")


@app.command()
def sweep(
    sweep_file: str | None = typer.Argument(
        None, help=f"a sweep YAML file, or a shipped sweep's name: {_shipped('sweeps')} (configs/sweeps/)"
    ),
    axis: list[str] = typer.Option(
        [],
        help="a grid axis, e.g. --axis diloco.learners=[2,4,8] (added to the file's grid, or replacing its axis)",
    ),
    base: str | None = typer.Option(
        None,
        help="the config every cell starts from (a shipped config's name or a YAML path; default: the file's, "
        "else tiny)",
    ),
    set_: list[str] = typer.Option([], "--set", help="a key set in every cell, e.g. --set train.token_budget=50000"),
    name: str | None = typer.Option(None, help="the sweep's name (its folder and concurrency limit)"),
    concurrency: int | None = typer.Option(None, help="cells at once (a Prefect global concurrency limit)"),
    launch: str | None = typer.Option(
        None, help="subflow (default: in this process) or deployment (a pipeline deployment's worker runs each cell)"
    ),
    deployment: str | None = typer.Option(
        None, help="with --launch deployment: the pipeline deployment (default pipeline/default)"
    ),
    sweep_dir: str | None = typer.Option(
        None, help="the sweep's folder (default <sweep_root>/<name>); an existing sweep folder is resumed"
    ),
):
    """Run a grid of pipeline runs (one per cell), resuming a sweep folder's finished cells, then
    write one comparison report across the cells.

    Exit status: 0 every cell completed; 1 a cell failed (the report covers the others); 2 refused
    before any work; 130/143 stopped by a signal (re-run to resume).
    """
    options = {"base": base, "name": name, "concurrency": concurrency, "launch": launch, "deployment": deployment}
    spec = _load("sweep", sweep_file, sets=set_, axes=axis, fields=options)
    plan = _preflight("sweep_preflight", spec, sweep_dir)
    for warning in plan.warnings:
        typer.echo(f"warning: {warning}", err=True)
    from flows.sweep import sweep as sweep_flow

    report = SweepLayout(plan.sweep_dir).comparison_md
    out = _run_flow(lambda: sweep_flow(spec=spec, sweep_dir=str(plan.sweep_dir)), report, "Sweep report")
    typer.echo(f"\nSweep report: {Path(out) / 'report' / 'comparison.md'}")


@app.command()
def tune(
    study_file: str = typer.Argument(
        "tune_tiny", help=f"a study YAML file, or a shipped study's name: {_shipped('studies')} (configs/studies/)"
    ),
    trials: int | None = typer.Option(None, help="trials per method (default: the file's)"),
    set_: list[str] = typer.Option(
        [],
        "--set",
        help="a config key set in every trial and in the tuned comparison, e.g. --set train.token_budget=50000",
    ),
    name: str | None = typer.Option(None, help="the study's name (its folder <study_root>/<name>)"),
    study_root: str | None = typer.Option(None, help="the folder holding study folders (default runs/studies)"),
    concurrency: int | None = typer.Option(None, help="trials at once (a Prefect global concurrency limit)"),
    compare: bool | None = typer.Option(
        None,
        "--compare/--no-compare",
        help="run both methods' best settings over the study's seeds after the trials (default: the file's)",
    ),
):
    """Tune DP and DiLoCo with the same number of trials and budget per trial (Optuna, its storage in
    the study folder), then compare the tuned methods over seeds; running it again resumes.

    Exit status: 0 done; 1 a method had no completed trial or the tuned comparison failed;
    2 refused before any work; 130/143 stopped by a signal (run it again to resume).
    """
    options = {"trials": trials, "name": name, "study_root": study_root, "concurrency": concurrency, "compare": compare}
    spec = _load("study", study_file, sets=set_, fields=options)
    plan = _preflight("tune_preflight", spec)
    from flows.tune import tune as tune_flow

    report_md = StudyLayout(plan.study_dir).study_md
    out = _run_flow(lambda: tune_flow(spec=spec), report_md, "Study report")
    for tuned in StudyLayout(Path(out)).tuned_runs:
        typer.echo(f"\nTuned comparison {tuned.name}:")
        _print_verdict(tuned)
    typer.echo(f"\nStudy report: {report_md}")


@app.command()
def goodput(
    out: str | None = typer.Option(None, help="run directory (default: runs/goodput-<time>)"),
    set_: list[str] = typer.Option(
        [],
        "--set",
        help="a simulator knob, e.g. --set chip_mtbi_years=0.5 --set restart_s=600 --set calibrate=true "
        "(docs/goodput.md)",
    ),
):
    """Failure simulator: goodput of DP, elastic DP and Decoupled DiLoCo against the paper's Table 1."""
    from configs.load import parse_overrides, validation_lines
    from sim import GoodputConfig

    knobs = _refused(parse_overrides, set_, example="chip_mtbi_years=0.5")
    try:
        cfg = GoodputConfig.model_validate(knobs)
    except ValidationError as exc:
        raise _fail("invalid goodput settings: " + "; ".join(validation_lines(exc, knobs)))
    out_dir = str(_check_out(out, goodput=True)) if out is not None else None
    from flows.goodput import goodput as goodput_flow
    from flows.server import start_temporary_server

    try:
        start_temporary_server()
        table = Path(goodput_flow(config=cfg, out_dir=out_dir))
    except (OSError, ValueError, RuntimeError) as exc:
        typer.echo(f"\nerror: {exc}", err=True)
        raise typer.Exit(1)
    text = table.read_text()
    typer.echo("\n" + text.split("## Uptime")[0].rstrip())
    typer.echo(f"\nTable: {table}\nFigure: {table.with_suffix('.png')}\nData: {table.with_suffix('.json')}")


@app.command()
def ui(
    host: str = typer.Option("127.0.0.1", help="the server's address (0.0.0.0: every interface)"),
    port: int = typer.Option(4200, help="the server's port"),
    deploy: bool = typer.Option(True, help="create every deployment of prefect.yaml"),
    worker: bool = typer.Option(True, help="start a process worker on local-proc"),
    log_dir: str = typer.Option("build/ui-stack", help="where the server, deploy and worker logs go"),
):
    """The Prefect UI stack: server, work pool, every deployment and a worker, started together;
    Ctrl-C stops them together (what `make ui` runs; docs/ui.md)."""
    from flows.ui_stack import run_stack

    if not 0 < port < 65536:
        raise _fail(f"--port {port}: give a port between 1 and 65535")
    if Path(log_dir).exists() and not Path(log_dir).is_dir():
        raise _fail(f"--log-dir {log_dir}: is a file, not a folder; give a folder for the logs")
    import socket

    try:
        socket.getaddrinfo(host, port)
    except OSError as exc:
        raise _fail(f"--host {host}: not an address of this machine ({exc}); e.g. 127.0.0.1 or 0.0.0.0")
    say = lambda line: typer.echo(line, err=line.startswith("error"))  # noqa: E731
    raise typer.Exit(run_stack(host, port, deploy=deploy, worker=worker, log_dir=Path(log_dir).absolute(), say=say))


@app.command()
def compare(
    run_dirs: list[str] | None = typer.Argument(
        None,
        help="run directories made by `ddiloco run`, each with report/report.json (`ddiloco report RUN` builds it)",
    ),
    out: str | None = typer.Option(
        None, help="new or empty folder for the comparison (default: runs/compare-<UTC time>)"
    ),
    axis: list[str] = typer.Option(
        [],
        help="a dotted config key to compare along, e.g. --axis diloco.learners (repeat it; default: the "
        "keys whose values differ)",
    ),
    title: str = typer.Option("Comparison", help="the comparison's title"),
):
    """Compare runs: a table row per run (held-out loss, DiLoCo − DP gap, time, tokens, bytes,
    post-training), and the loss and gap plotted along the first axis that varies.

    Writes comparison.md, comparison.json, comparison.csv and PNG plots into --out. Exit status:
    0 done; 1 failed while writing; 2 refused before anything was written.
    """
    from reports.compare import build_comparison
    from run.directory import default_run_dir

    if not run_dirs:
        raise _fail("no run directories given: ddiloco compare RUN_DIR... (folders made by `ddiloco run`)")
    out_dir = _check_out(out if out is not None else str(default_run_dir("runs", "compare")))
    axes = [a.strip() for item in axis for a in item.split(",") if a.strip()] or None
    try:
        result = build_comparison(run_dirs, out_dir, axes=axes, title=title)
    except ValueError as exc:  # ReportInputError too: checked before anything is written
        raise _fail(str(exc).replace("\n", " "))
    except OSError as exc:
        raise _fail(str(exc), code=1)
    typer.echo(f"Comparison: {result['paths']['markdown']}")


# typer 0.29's rich help keeps a docstring paragraph's line breaks after the first one: join them
for _info in app.registered_commands:
    _info.help = "\n\n".join(" ".join(p.split()) for p in inspect.getdoc(_info.callback).split("\n\n"))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
