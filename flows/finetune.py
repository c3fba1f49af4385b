"""The fine-tuning flow: one recipe applied identically to every pretrained model of a run
directory, evaluated before and after, then the report rebuilt.

Also the pipeline's ``finetune`` stage (as a subflow). Every check runs before anything is written
(:func:`finetune_preflight`): the run directory, its config with ``finetune.*`` overrides, the
pretrained checkpoints, existing fine-tuning results and the task's inputs.
"""

# No `from __future__ import annotations`: Prefect validates flow parameters from the annotations
# (see flows/pipeline.py).

import json
import re
import shutil
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from pydantic import ValidationError

from configs.load import apply_overrides, validation_lines
from configs.schema import ExperimentConfig
from flows import run_logger
from flows.naming import finetune_run_name
from flows.preflight import check_finetune_inputs, check_lora_targets
from run.control import graceful_stop, stop_requested
from run.directory import link_or_copy
from run.layout import METHOD_ORDER, RunLayout
from tasks.finetune import evaluate_finetune_task, finetune_data_task, finetune_task
from training.ckpt_steps import LOADED_ITEMS, complete_steps, step_folders
from training.finetune import finetune_record

__all__ = ["finetune", "finetune_preflight", "FinetunePlan"]


class FinetunePlan(dict):
    """What a fine-tuning run will do: ``cfg``, ``run_dir``, ``methods`` ({name: checkpoint or None})."""


def _run_root_of(checkpoint: Path) -> Path:
    for p in [checkpoint, *checkpoint.parents]:
        if RunLayout(p).config.is_file() and RunLayout(p).manifest.is_file():
            return p
    raise ValueError(
        f"--checkpoint {checkpoint}: no run directory above it (a folder with config.json and "
        "data/manifest.json); give a checkpoint folder of one of our runs, e.g. RUN/pretrain/dp/checkpoints"
    )


def finetune_preflight(
    run_dir: str | None,
    methods: list[str] | None = None,
    checkpoint: str | None = None,
    name: str | None = None,
    overrides: dict[str, Any] | None = None,
    replace: bool = False,
) -> FinetunePlan:
    """Check everything a fine-tuning run needs, write nothing; return the plan.

    ``run_dir``: the run to fine-tune (optional with ``checkpoint``: the run holding it). ``methods``:
    the pretrained methods to fine-tune (default every method with a pretrained checkpoint).
    ``checkpoint``: instead, one Orbax checkpoint folder of ours, fine-tuned as method ``name``
    (default ``<method>-ckpt``). ``overrides``: dotted ``finetune.*`` keys. ``replace``: delete this
    run's earlier fine-tuning results first (after every check passed).

    Every checkpoint to fine-tune must hold a complete step (:func:`training.ckpt_steps.complete_steps`:
    what the loaders would refuse later is refused here). ``name`` may not be a pretraining method's
    (this run's, or ``diloco``/``dp``) unless ``checkpoint`` is that method's own folder: the report
    shows a method's fine-tuned figures beside its pretraining.

    Raises ``ValueError`` / ``FileNotFoundError`` with one line naming the argument or field and the fix.
    """
    bad = [k for k in (overrides or {}) if not str(k).startswith("finetune.")]
    if bad:
        raise ValueError(f"--set {bad[0]}: only finetune.* fields can change after pretraining")
    if "finetune.enabled" in (overrides or {}):
        raise ValueError(
            "--set finetune.enabled: `ddiloco finetune` always fine-tunes; the field switches the "
            "pipeline's stage (ddiloco run)"
        )
    if name and not checkpoint:
        raise ValueError("--name names the results of --checkpoint; give both, or neither")
    ckpt = Path(checkpoint).expanduser().resolve() if checkpoint else None
    if ckpt is not None:
        if not ckpt.is_dir():
            raise FileNotFoundError(
                f"--checkpoint {checkpoint} is not a folder; give an Orbax checkpoint folder "
                "(e.g. RUN/pretrain/dp/checkpoints)"
            )
        if (
            ckpt.name.isdigit()
            and (ckpt / "_CHECKPOINT_METADATA").exists()
            or ckpt.name.isdigit()
            and (ckpt / "params").is_dir()
        ):
            raise ValueError(
                f"--checkpoint {checkpoint} is one step of a checkpoint folder; give the folder that "
                f"holds the steps: {ckpt.parent}"
            )
        if not any(p.name.isdigit() and p.is_dir() for p in ckpt.iterdir()):
            raise FileNotFoundError(
                f"--checkpoint {checkpoint} holds no checkpoint step (numbered folders); give an "
                "Orbax checkpoint folder such as RUN/pretrain/dp/checkpoints"
            )
        if not complete_steps(ckpt):
            raise FileNotFoundError(
                f"--checkpoint {checkpoint} holds no complete checkpoint step (its step folders "
                f"{', '.join(step_folders(ckpt)[:3])} lack {' or '.join(i + '/' for i in LOADED_ITEMS)}: an "
                "interrupted save); give a complete checkpoint folder, or re-run pretraining for that method"
            )
        root = _run_root_of(ckpt)
        if run_dir and Path(run_dir).resolve() != root:
            raise ValueError(f"--checkpoint {checkpoint} belongs to {root}, not {run_dir}; give one of them")
        run_dir = str(root)
    if not run_dir:
        raise ValueError("give a run directory (or --checkpoint)")
    rd = Path(run_dir)
    layout = RunLayout(rd)
    if not layout.config.is_file() or not layout.manifest.is_file():
        raise FileNotFoundError(
            f"{rd} is not a run directory with prepared data (config.json and data/manifest.json); "
            "give a directory made by `ddiloco run`"
        )
    raw = json.loads(layout.config.read_text())
    try:
        cfg = ExperimentConfig.model_validate(apply_overrides(raw, {"finetune.enabled": True, **(overrides or {})}))
    except ValidationError as exc:
        raise ValueError("invalid fine-tuning settings: " + "; ".join(validation_lines(exc))) from None
    if ckpt is not None:
        if methods:
            raise ValueError("give --checkpoint or --methods, not both")
        method = name or f"{ckpt.parent.name}-ckpt"
        pretrained = layout.methods("pretrain")
        if name in {*METHOD_ORDER, *pretrained} and ckpt != Path(layout.checkpoints("pretrain", name)).resolve():
            # the report shows a method's fine-tuned figures beside its pretraining: another model's
            # checkpoint under that name would compare, e.g., DP with DP under DiLoCo's heading
            if name in pretrained:
                raise ValueError(
                    f"--name {name} is this run's pretrained method (its checkpoint is "
                    f"{layout.checkpoints('pretrain', name)}); pick another name"
                )
            raise ValueError(
                f"--name {name} is a pretraining method's name (the report would show this checkpoint "
                "as that method); pick another name"
            )
        plan_methods = {method: str(ckpt)}
    else:
        have = [m for m in layout.methods("pretrain") if layout.checkpoints("pretrain", m).is_dir()]
        chosen = methods or have
        missing = [m for m in chosen if m not in have]
        if missing:
            raise FileNotFoundError(
                f"{rd} has no pretrained checkpoint of {missing[0]} (has: {', '.join(have) or 'none'}); pick from those"
            )
        if not chosen:
            raise FileNotFoundError(f"{rd} holds no pretrained checkpoint yet; pretrain first (`ddiloco run`)")
        usable = [m for m in chosen if complete_steps(layout.checkpoints("pretrain", m))]
        for m in chosen:
            if m not in usable:  # the loader would refuse it only after the data step and the server
                found = step_folders(layout.checkpoints("pretrain", m))
                raise FileNotFoundError(
                    f"{rd}: the pretrained checkpoint of {m} ({layout.checkpoints('pretrain', m)}) holds no complete "
                    "checkpoint step ("
                    + (f"only partial steps: {', '.join(found[:3])}" if found else "it is empty")
                    + f"); re-run pretraining of {m}"
                    + (f", or fine-tune the others alone with --methods {','.join(usable)}" if usable else "")
                )
        plan_methods = {m: None for m in chosen}
    for m in plan_methods:
        RunLayout(rd).method_dir("finetune", m)  # a valid method name
        if layout.holds_results("finetune", m) and not replace:
            raise FileExistsError(
                f"{rd} already holds fine-tuning results of {m}; pass --replace to fine-tune it "
                "again (its earlier results are deleted once the new ones are written)"
                + (", or another --name" if ckpt is not None else "")
            )
    recipe = finetune_record(cfg)
    for m in layout.methods("finetune"):
        if m in plan_methods or not layout.summary("finetune", m).is_file():
            continue
        other = json.loads(layout.summary("finetune", m).read_text()).get("finetune_config")
        if other is not None and other != recipe:
            diff = sorted(k for k in {*other, *recipe} if other.get(k) != recipe.get(k))
            raise ValueError(
                f"{rd}: {m} was fine-tuned with another recipe ({', '.join(diff[:4])} differ); a run "
                "directory compares its methods under one recipe: fine-tune every method again "
                "(no --methods) with --replace, or keep the recipe"
            )
    from data.store import load_manifest
    from training.common import input_shape

    check_lora_targets(cfg, input_shape(cfg, load_manifest(rd)))
    if cfg.finetune_task == "speakers" and not (layout.data / "heldout_finetune.jsonl").is_file():
        raise ValueError(
            f"{rd} was prepared with data.finetune_docs: 0, so no play was held out for the speakers task; "
            "use --set finetune.source=jsonl with finetune.paths, or a new run with data.finetune_docs"
        )
    check_finetune_inputs(cfg)
    return FinetunePlan(cfg=cfg, run_dir=rd, methods=plan_methods, replace=replace)


def _results(layout: RunLayout, method: str) -> list[Path]:
    out = [Path(p) for p in layout.holds_results("finetune", method)]
    extra = Path(layout.eval_outputs("finetune", method))
    return out + ([extra] if extra.exists() else [])


def _put_data_aside(data: Path, tag: str) -> Path | None:
    """Keep the task's items ``data`` (``RUN/finetune/data``) as ``.data.replaced-<tag>`` beside it
    while the folder stays in place: a copy of hard links (no bytes copied; the data step never writes
    a file in place, it swaps a new folder in), or of bytes where the filesystem has no hard links.
    Returns the copy, or None when there is no data yet."""
    if not data.is_dir():
        return None
    dst = data.with_name(f".{data.name}.replaced-{tag}")
    shutil.copytree(data, dst, copy_function=link_or_copy)
    return dst


_ASIDE = re.compile(r"^\.(?P<name>.+)\.replaced-[0-9a-f]{8}$")


def _recover_aside(layout: RunLayout) -> list[str]:
    """Results a ``--replace`` put aside and never got back to (its process was killed: no handler
    ran). One whose place is empty is moved back (the replace never wrote anything there); one whose
    place holds newer results is kept where it is, with a warning that names both (whether those are
    complete cannot be told here, so nothing is deleted). Returns one line per item found."""
    lines: list[str] = []
    data = Path(layout.finetune_data)
    data_asides = (
        sorted(data.parent.glob(f".{data.name}.replaced-*"), key=lambda p: p.stat().st_mtime)
        if data.parent.is_dir()
        else []
    )  # oldest first
    moved = kept = 0
    for folder in (layout.stage_dir("finetune"), layout.eval_dir("finetune")):
        if not folder.is_dir():
            continue
        for p in sorted(folder.iterdir()):
            m = _ASIDE.match(p.name)
            if m is None or p in data_asides:
                continue
            orig = p.with_name(m["name"])
            kept += orig.exists()
            moved += not orig.exists()
            if not orig.exists():
                p.rename(orig)
                lines.append(
                    f"{orig}: moved back from {p.name} (an earlier --replace was killed before it wrote new results)"
                )
            else:
                lines.append(
                    f"{p}: earlier results an interrupted --replace put aside; {orig} holds newer ones. "
                    f"Delete {p.name} to keep the newer, or put it back in place of {orig.name}"
                )
    for p in data_asides:  # the task's items the put-aside results were made from
        if moved and p == data_asides[-1]:  # results came back: so does their data
            shutil.rmtree(data, ignore_errors=True)
            p.rename(data)
            lines.append(f"{data}: moved back from {p.name} with the results made from it")
        elif kept:
            lines.append(f"{p}: the task data of the put-aside results above; keep or delete it with them")
        else:  # the replace had finished its results and was killed while cleaning up
            shutil.rmtree(p, ignore_errors=True)
            lines.append(f"{p}: removed (an earlier --replace had finished its results)")
    for line in lines:
        run_logger().warning(line)
    return lines


def run_finetune_stage(plan: FinetunePlan) -> dict:
    """Prepare the task, fine-tune and evaluate every planned method, in order. Returns
    ``{"task": …, "methods": {method: {"summary", "eval"}}, "interrupted": bool}``.

    With ``replace``, earlier results of the planned methods, and the task's items they were made
    from (``finetune/data``, which a new recipe rebuilds), are put aside first and deleted only once
    the new ones are written; if the stage fails they are moved back (and a method's partial new
    results removed), so a failed re-run loses nothing."""
    import uuid

    cfg, rd = plan["cfg"], str(plan["run_dir"])
    layout = RunLayout(rd)
    _recover_aside(layout)
    aside: list[tuple[Path, Path]] = []
    data = Path(layout.finetune_data)
    data_aside = None
    if plan.get("replace"):
        tag = uuid.uuid4().hex[:8]
        data_aside = _put_data_aside(data, tag)
        for m in plan["methods"]:
            for p in _results(layout, m):
                dst = p.with_name(f".{p.name}.replaced-{tag}")
                p.rename(dst)
                aside.append((p, dst))
    out: dict[str, Any] = {"task": None, "methods": {}, "interrupted": False}
    try:
        out["task"] = task_info = finetune_data_task(cfg, rd)
        for method, ckpt in plan["methods"].items():
            if stop_requested():
                break
            summary = finetune_task(cfg, rd, method, task_info, ckpt)
            if summary.get("interrupted") or stop_requested():
                out["methods"][method] = {"summary": summary}
                break
            out["methods"][method] = {
                "summary": summary,
                "eval": evaluate_finetune_task(cfg, rd, method, task_info, ckpt),
            }
    except BaseException:
        if not stop_requested():
            for m in plan["methods"]:  # a failed method's partial results would read as a method
                for p in _results(layout, m):
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            for orig, dst in aside:
                dst.rename(orig)
            if data_aside is not None:
                shutil.rmtree(data, ignore_errors=True)
                data_aside.rename(data)
        raise
    for _, dst in [*aside, *([(data, data_aside)] if data_aside is not None else [])]:
        shutil.rmtree(dst, ignore_errors=True) if dst.is_dir() else dst.unlink(missing_ok=True)
    out["interrupted"] = stop_requested()
    return out


@flow(name="finetune", flow_run_name=finetune_run_name, log_prints=True)
def finetune(
    run_dir: str | None = None,
    methods: list[str] | None = None,
    checkpoint: str | None = None,
    name: str | None = None,
    # a plain dict, never mutated: the UI form gives it a JSON editor (an Optional dict shows as a
    # dict/None switch with nothing to edit)
    overrides: dict[str, Any] = {},  # noqa: B006
    replace: bool = False,
    build_report: bool = True,
) -> str:
    """Fine-tune a run's pretrained models with one recipe (``finetune.*`` of its config, changed by
    ``overrides``), evaluate them before and after, and rebuild the report.

    Args:
        run_dir: a run directory made by the pipeline.
        methods: pretrained methods to fine-tune (default: all with a checkpoint).
        checkpoint: instead, an Orbax checkpoint folder of ours (its run directory is used).
        name: the method name for ``checkpoint``'s results.
        overrides: dotted ``finetune.*`` keys, e.g. ``{"finetune.mode": "lora"}``.
        replace: delete earlier fine-tuning results of these methods first.
        build_report: rebuild ``report/`` at the end (the pipeline builds it itself).

    Returns the run directory. Raises ``ValueError``/``FileNotFoundError``/``FileExistsError`` from
    :func:`finetune_preflight` before anything is written.
    """
    plan = finetune_preflight(run_dir, methods, checkpoint, name, overrides, replace)
    logger = get_run_logger()
    with graceful_stop():
        result = run_finetune_stage(plan)
        if build_report:  # run alone: the run's record gains the stage
            from run.directory import read_status, write_status

            old = read_status(plan["run_dir"])
            if old.get("status") and not result["interrupted"]:
                done = [s for s in old.get("completed_stages", []) if s not in ("finetune", "report")]
                write_status(plan["run_dir"], old["status"], done + ["finetune", "report"], old.get("reason"))
            from tasks.evaluate import report_task

            report_task(plan["run_dir"], final_stage=False)
            logger.info("report: %s", RunLayout(plan["run_dir"]).report_md)
    if result["interrupted"]:
        from prefect.states import Cancelled

        return Cancelled(message="fine-tuning stopped by a signal; what finished is saved")
    return str(plan["run_dir"])
