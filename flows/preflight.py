"""Every check before any work: the preflights of a run (:func:`preflight`, returns the run
directory), a sweep (:func:`sweep_preflight`), a study (:func:`tune_preflight`) and a fine-tuning run
(:func:`finetune_preflight`). Each takes a validated config or spec (``configs.specs.load_spec``),
checks folders, corpus, model, devices, earlier results and a Prefect server where one is needed,
writes nothing, and returns the plan its flow runs.

A refusal is a ``ValueError`` or an ``OSError`` (``FileNotFoundError``, ``FileExistsError``,
``ConnectionError``) whose message is one line naming the field, option or path and the fix: the
CLI prints it and exits 2. The flows call their preflight again first thing (a run started from the
UI never went through the CLI).
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from configs.load import apply_overrides
from configs.runtime import RuntimeConfig
from configs.schema import ExperimentConfig, validate_against_model
from configs.specs import load_spec, read_base
from configs.sweep import Cell, SweepSpec, cell_config, config_digest, expand_cells
from configs.tune import METHODS, TuneSpec
from run.directory import check_run_dir, default_run_dir, is_run, read_status
from run.layout import METHOD_ORDER, SWEEP_RECORD, RunLayout, StudyLayout, SweepLayout

DIGITS_IMAGES = 1797  # scikit-learn's load_digits


def check_reusable_data(path: Path, data, learners: int) -> None:
    """A run directory that already holds ``data/`` (an earlier run's, that never trained) is used
    only when that data was built from the data section ``data`` for ``learners`` learners; else
    ``ValueError`` naming the folder and the fix."""
    folder = RunLayout(path).data
    if not folder.exists() and not folder.is_symlink():
        return
    from data.store import load_manifest
    from data.text import config_record

    try:
        manifest = load_manifest(path)
        if not isinstance(manifest, dict):
            raise ValueError("its manifest.json is not a JSON object")
        old = manifest.get("config")
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise ValueError(
            f"run directory {path} holds a data folder that cannot be reused ({exc}); choose a new --run-dir"
        ) from None
    if old != config_record(data, learners):
        raise ValueError(
            f"run directory {path} holds data built from another data config or learner count; choose a new --run-dir"
        )


def _abstract_model(model, shape):
    """The model of section ``model`` for ``shape``, built abstractly (shapes only, no compute)."""
    from flax import nnx

    from models import build_model

    return nnx.eval_shape(lambda: build_model(model, shape).init(0))


def check_model(model, diloco, shape) -> int:
    """Build the model of section ``model`` abstractly for ``shape`` (an ``InputShape``; None: images
    not read yet, skipped) and check ``diloco.fragments`` against its tensors. Returns the number of
    parameter tensors (0: not checked). Raises ``ValueError``."""
    from training.functional import params_of

    if shape is None:
        return 0
    try:
        n = len(params_of(_abstract_model(model, shape)))
    except ValueError as exc:  # e.g. a patch size that does not divide the images
        raise ValueError(f"model ({model.kind}) does not fit the data: {exc}") from None
    validate_against_model(diloco, n)
    return n


def _check_image_folder(cfg: ExperimentConfig) -> None:
    """An imagefolder's headers, splits, model and LoRA targets; its val split holds one held-out batch."""
    import numpy as np

    from data.images import ImageSet, complete_splits, inspect_image_folder, scan_image_folder
    from models import InputShape

    d, batch = cfg.data, cfg.train.eval_batch_size
    folder = scan_image_folder(d.paths[0])
    for split in ("val", "test"):
        name = f"{split}_fraction"
        if split in folder.files and getattr(d, name) != type(d).model_fields[name].default:
            raise ValueError(
                f"data.{name}: {d.paths[0]} has a {split} split folder, which is the {split} split as is; "
                f"remove data.{name}"
            )
    found = inspect_image_folder(folder, d.image_size, d.channels)
    shape = InputShape(image_shape=found["image_shape"], num_classes=found["num_classes"], pixel_max=255)
    check_model(cfg.model, cfg.diloco, shape)
    check_lora_targets(cfg.finetune, cfg.model, shape)
    labels, given = folder.labels_and_splits()  # the data step's exact split, from the file list
    splits, source = complete_splits(
        ImageSet(np.empty(0), labels, folder.classes, 255, {}, given), d.val_fraction, d.test_fraction, d.seed
    )
    if len(splits["val"]) < batch:
        in_folder = source["val"] == "folder"
        where = (
            f"the val split folder of {d.paths[0]}"
            if in_folder
            else f"data.val_fraction ({d.val_fraction}) of the "
            + (f"{len(labels)} images" if given is None else f"{len(given['train'])} train/ images")
        )
        raise ValueError(
            f"{where} holds {len(splits['val'])} validation images, fewer than train.eval_batch_size "
            f"({batch}) for one held-out batch; "
            f"{'add validation images' if in_folder else 'raise data.val_fraction'} or lower train.eval_batch_size"
        )


def check_image_source(cfg: ExperimentConfig) -> None:
    """Cheap checks of an image source: an imagefolder (:func:`_check_image_folder`), the validation
    split of digits, a reachable hub dataset. Raises ``ValueError``/``FileNotFoundError``/
    ``ConnectionError`` in one line."""
    d, batch = cfg.data, cfg.train.eval_batch_size
    if d.source == "imagefolder":
        _check_image_folder(cfg)
    elif d.source == "digits" and int(DIGITS_IMAGES * d.val_fraction) < batch:
        # (the stratified split rounds per class, give or take a few)
        raise ValueError(
            f"data.val_fraction ({d.val_fraction}) of {DIGITS_IMAGES} images holds about "
            f"{int(DIGITS_IMAGES * d.val_fraction)} validation images, fewer than train.eval_batch_size "
            f"({batch}) for one held-out batch; raise data.val_fraction or lower train.eval_batch_size"
        )
    elif d.source == "hf_images":
        from data.sources import check_hf_reachable

        check_hf_reachable(
            d.hf_name,
            "use data.source: digits (bundled) or imagefolder with data.paths: [a folder of class sub-folders] instead",
        )


def check_finetune_inputs(ft, task: str, seed: int) -> None:
    """The inputs of fine-tuning task ``task`` (``cfg.finetune_task``) of recipe ``ft``: JSONL pairs are
    read and counted (one file split with ``seed``, the data seed), a hub dataset is reachable. Raises
    ``ValueError`` / ``FileNotFoundError`` / ``ConnectionError``."""
    if task == "jsonl":
        from data.finetune import MIN_TEST_ITEMS, MIN_TRAIN_ITEMS, load_jsonl_pair_files, split_items

        pairs = load_jsonl_pair_files(ft.paths, ft.prompt_field, ft.response_field)  # (ids checked across files)
        counts = [len(p) for p in pairs if p is not None]
        train, test = map(len, split_items(counts[0], ft.test_fraction, seed)) if len(counts) == 1 else counts
        if train < MIN_TRAIN_ITEMS or test < MIN_TEST_ITEMS:
            raise ValueError(
                f"finetune.paths: {train} train and {test} test pairs, fewer than {MIN_TRAIN_ITEMS} and "
                f"{MIN_TEST_ITEMS}; give more pairs"
            )
    elif task == "hf" and not Path(ft.hf_name).expanduser().is_dir():
        from data.sources import check_hf_reachable

        check_hf_reachable(
            ft.hf_name, "use finetune.source: jsonl with finetune.paths instead", field="finetune.hf_name"
        )


def check_lora_targets(ft, model, shape) -> None:
    """With ``finetune.mode: lora`` (recipe ``ft``), every name of ``finetune.lora_targets`` is a
    projection of the model of section ``model`` (built abstractly for ``shape``, as
    :func:`check_model`) and the rank is below each one's smaller side. Raises ``ValueError``."""
    if ft.mode != "lora" or shape is None:
        return
    from models.layers.lora import linear_layers

    layers = linear_layers(_abstract_model(model, shape))
    names = {n for n, _ in layers.values()}
    missing = [t for t in ft.lora_targets if t not in names]
    if missing:
        raise ValueError(
            f"finetune.lora_targets: {missing[0]!r} is no projection of a {model.kind} model; its "
            f"projections are {', '.join(sorted(names))}"
        )
    small = min(min(io) for n, io in layers.values() if n in ft.lora_targets)
    if ft.lora_rank >= small:
        raise ValueError(
            f"finetune.lora_rank ({ft.lora_rank}) must be below the smallest adapted projection's side ({small})"
        )


def _check_writable(key: str, where: str, fix: str) -> None:
    """``where`` (a folder or fsspec URL) takes a probe file (``training.exchange_checks``), else ``ValueError``."""
    from training.exchange_checks import check_writable  # no JAX

    try:
        check_writable(where)
    except Exception as exc:  # whatever the filesystem raises (OSError, NotImplementedError, its own)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(f"{key}: cannot be created or written here ({type(exc).__name__}: {first}); {fix}") from None


def check_runtime(rt: RuntimeConfig) -> None:
    """The engine and exchange of ``runtime`` before anything starts: an fsspec ``exchange_url`` of a
    usable form whose protocol is installed and whose root takes a probe file (removed again), a
    writable ``compilation_cache``, an existing cluster's ``address`` that answers (TCP, 5 s) and, for
    Ray, accepts our authentication. Raises ``ValueError`` naming the field, or ``ConnectionError``
    naming ``runtime.address``."""
    url = rt.exchange_url if rt.exchange_kind == "fsspec" else None
    if url:
        import fsspec

        from training.exchange_checks import check_url  # no JAX

        try:
            check_url(url)
        except ValueError as exc:
            raise ValueError(f"runtime.exchange_url {exc}") from None
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            raise ValueError(
                f"runtime.exchange_url {url}: no fsspec implementation of {protocol}:// here "
                f"({str(exc).splitlines()[0]}); install it (`uv sync --extra s3` for s3://, gcsfs for "
                "gs://) or use a shared folder"
            ) from None
        # an s3:// exchange's credentials come from every process's environment, as botocore reads them
        fix = (
            "give a prefix of an existing bucket that the credentials in the environment (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE; AWS_ENDPOINT_URL_S3 for an S3-compatible server) can write"
            if protocol in ("s3", "s3a")
            else "give a folder or bucket prefix this user can write and every worker can reach"
        )
        _check_writable(
            f"runtime.exchange_url {url}", url, f"{fix}, or unset it (the exchange then lives in the run directory)"
        )
    if rt.compilation_cache not in (None, "run"):
        _check_writable(
            f"runtime.compilation_cache {rt.compilation_cache}",
            str(Path(rt.compilation_cache).expanduser().absolute()),
            "give a folder this user can write, or run (the run directory's cache/xla), or off",
        )
    if rt.address and rt.address != "auto":
        _check_address(rt)


def _check_address(rt: RuntimeConfig) -> None:
    """``runtime.address`` is host and port, something answers there, and Ray accepts our authentication."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(rt.address if "://" in rt.address else f"tcp://{rt.address}")
    if not url.hostname or not url.port:
        example = "head:6379" if rt.engine == "ray" else "tcp://scheduler:8786"
        raise ValueError(f"runtime.address {rt.address}: give host and port, e.g. {example}")
    try:
        socket.create_connection((url.hostname, url.port), timeout=5).close()
    except OSError as exc:
        raise ConnectionError(
            f"runtime.address {rt.address}: nothing answers there ({exc}); start the "
            f"{rt.engine} cluster first or unset runtime.address for a local one"
        ) from None
    if rt.engine == "ray" and "://" not in rt.address:
        check_ray_authentication(rt.address)


def check_ray_authentication(address: str) -> None:
    """A Ray cluster's GCS at ``address`` (host:port) accepts this process's authentication (Ray 2.60's
    ``ray start`` turns token authentication on; without the token a run would fail only after ~50 s of
    retries): one GCS client connection, no driver. Raises ``ConnectionError`` naming
    ``runtime.address`` and the variables to set; anything else is left to the run."""
    import ray._raylet
    from ray.exceptions import AuthenticationError

    saved = os.dup(2)  # (Ray's C++ client logs each refused attempt on fd 2 itself: the refusal is ours)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
            ray._raylet.GcsClient(address=address)
    except AuthenticationError:
        mode = os.environ.get("RAY_AUTH_MODE") or "unset"
        raise ConnectionError(
            f"runtime.address {address}: the Ray cluster refused this process's authentication "
            f"(RAY_AUTH_MODE {mode}, RAY_AUTH_TOKEN {'set' if os.environ.get('RAY_AUTH_TOKEN') else 'unset'}); "
            "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token in this environment "
            "(docs/scale-out.md, On a cluster you start)"
        ) from None
    except Exception:  # noqa: BLE001 - a slow or odd GCS: ray.init reports it in the run
        return
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def check_installed(cfg: ExperimentConfig) -> None:
    """What the config asks of this machine beyond the packages it always has: ``network.emulate``
    can run here (``run.netem.emulation_problem``; moto's S3 server for DiLoCo's exchange) and
    ``tracking.wandb`` has its package (looked up, not imported). Raises ``ValueError``."""
    if cfg.network.emulate:
        from run.netem import emulation_problem

        problem = emulation_problem()
        if problem:
            raise ValueError(problem)
        if cfg.diloco.enabled and not (Path(sys.executable).parent / "moto_server").exists():
            raise ValueError(
                "network.emulate puts DiLoCo's exchange on moto's S3 server, which is not installed here: "
                "uv sync --extra emulate (make setup installs it)"
            )
    if cfg.tracking.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            "tracking.wandb: true needs the wandb package, which is not installed here: "
            "`uv sync --extra wandb` (or pip install wandb), or set tracking.wandb: false"
        )


def learner_device_pool(rt: RuntimeConfig, learners: int) -> tuple[list, str] | None:
    """The devices each of ``learners`` learner processes will see, and how to name their owner, where
    known before the run: this process's (threads; a local Dask cluster's workers inherit them), a local
    Ray learner's requested GPUs (``flows.engines.learner_gpus``), else this process's CPU devices. None
    for an existing cluster (``runtime.address``) or a CPU learner of Ray on a GPU host. Starts JAX."""
    import jax

    devices = jax.devices()
    if rt.engine == "threads":
        return devices, "this process"
    if rt.address is not None:
        return None
    if rt.engine == "dask":
        return devices, "each worker of the local Dask cluster (they start with this process's devices)"
    from flows.engines import learner_gpus

    gpus = [d for d in devices if d.platform == "gpu"]
    g = learner_gpus(rt, learners, len(gpus))
    if g:
        return gpus[:g], f"each learner's Ray task (its {g} GPU(s): runtime.learner_gpus)"
    if gpus:
        return None
    return devices, "each worker of the local Ray instance (they start with this process's devices)"


def check_devices(cfg: ExperimentConfig) -> None:
    """``runtime.devices_per_learner`` against each learner's devices where known
    (:func:`learner_device_pool`; ``training.mesh.learner_devices``), and the DP batch against this
    process's devices times ``dp.hosts`` (``training.dp.dp_devices``). Starts JAX. Raises ``ValueError``."""
    from training.dp import dp_devices
    from training.mesh import learner_devices

    known = learner_device_pool(cfg.runtime, cfg.diloco.learners)
    if known is not None:
        learner_devices(0, cfg.runtime.devices_per_learner, known[0], where=known[1])
    if cfg.dp.enabled:
        import jax

        dp_devices(cfg, jax.devices() * cfg.dp.hosts)  # each host process as many devices as this one


def check_config(cfg: ExperimentConfig, check_data: bool = True) -> None:
    """Every check of a config that needs no run directory, cheapest first: runtime, installed extras,
    model, devices, fine-tuning inputs, then the corpus (local files, a hub's reachability,
    ``data.sources.check_corpus``; images: :func:`check_image_source`) unless ``check_data`` is False."""
    check_runtime(cfg.runtime)
    check_installed(cfg)
    from models import InputShape

    d, shape = cfg.data, None  # (other images: their headers tell, check_image_source)
    if d.modality != "image":
        shape = InputShape(vocab_size=d.vocab_size, seq_len=d.seq_len)
    elif d.source == "digits":
        shape = InputShape(image_shape=(8, 8, d.channels or 1), num_classes=10, pixel_max=16)
    check_model(cfg.model, cfg.diloco, shape)
    check_devices(cfg)
    if cfg.finetune.enabled:
        check_finetune_inputs(cfg.finetune, cfg.finetune_task, cfg.data.seed)
        check_lora_targets(cfg.finetune, cfg.model, shape)
    if check_data and cfg.data.modality == "image":
        check_image_source(cfg)
    elif check_data:
        from data.sources import check_corpus

        check_corpus(cfg.data)


def preflight(cfg: ExperimentConfig, run_dir: str | Path | None = None, check_data: bool = True) -> Path:
    """Check the run directory (``run.directory.check_run_dir``; ``<run_root>/<name>-<time>`` when
    ``run_dir`` is None), data an earlier run left there, then :func:`check_config`; return the run
    directory. Writes nothing but the corpus download cache. Raises ``ValueError`` or ``OSError``."""
    path = check_run_dir(run_dir if run_dir is not None else default_run_dir(cfg.run_root, cfg.name))
    check_reusable_data(path, cfg.data, cfg.diloco.learners)
    check_config(cfg, check_data)
    return path


def _within(where: str, exc: Exception) -> Exception:
    """``exc`` of the same kind, its message prefixed with ``where`` (a sweep's cell, a study's arm)."""
    try:
        return type(exc)(f"{where}: {exc}")
    except TypeError:  # an exception class that takes more than a message
        return ValueError(f"{where}: {exc}")


# -- a sweep -------------------------------------------------------------------------------------
@dataclass
class PlannedCell:
    """A cell as the sweep will treat it: ``action`` is ``run`` (new), ``skip`` (completed with
    this config) or ``rerun`` (an earlier attempt that did not complete; ``previous`` its status)."""

    cell: Cell
    cfg: ExperimentConfig
    run_dir: Path
    digest: str
    action: str
    previous: str | None = None


@dataclass
class SweepPlan:
    """What a sweep will do: its folder, each cell's plan, and warnings to show (no worker yet)."""

    spec: SweepSpec
    sweep_dir: Path
    cells: list[PlannedCell]
    warnings: list[str] = field(default_factory=list)

    def record(self, results: dict[str, dict] | None = None) -> dict:
        """What ``sweep.json`` holds: the spec and one entry per cell."""
        results = results or {}
        return {
            "sweep": self.spec.model_dump(mode="json"),
            "sweep_dir": str(self.sweep_dir),
            "updated_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "cells": [
                {
                    "name": pc.cell.name,
                    "overrides": pc.cell.overrides,
                    "config_sha256": pc.digest,
                    "run_dir": str(pc.run_dir),
                    "action": pc.action,
                    "previous": pc.previous,
                    **results.get(pc.cell.name, {}),
                }
                for pc in self.cells
            ],
        }


def check_deployment(spec: SweepSpec) -> str | None:
    """With ``launch: deployment``: a Prefect server answers and holds the pipeline deployment (else
    ``ValueError``). Returns a warning when no worker polls its work pool, else None."""
    if spec.launch != "deployment":
        return None
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise ValueError(
            f"sweep {spec.name}: launch: deployment runs each cell through a deployment's worker, which needs "
            "a Prefect server: set PREFECT_API_URL (see the README's UI section) or use --launch subflow"
        )
    with get_client(sync_client=True) as client:
        try:
            dep = client.read_deployment_by_name(spec.deployment)
            pool = client.read_work_pool(dep.work_pool_name) if dep.work_pool_name else None
        except ObjectNotFound:
            raise ValueError(
                f"sweep {spec.name}: deployment: {spec.deployment} is not deployed on the Prefect server "
                f"{client.api_url}; deploy it (`prefect --no-prompt deploy --all`) and start a worker, "
                "or use launch: subflow"
            ) from None
        except Exception as exc:  # the server does not answer (connection refused, timeout, ...)
            raise ValueError(
                f"sweep {spec.name}: launch: deployment: the Prefect server {client.api_url} "
                f"(PREFECT_API_URL) does not answer ({type(exc).__name__}); start it or use launch: "
                "subflow"
            ) from None
    if pool is not None and str(getattr(pool.status, "value", pool.status)).upper() != "READY":
        return (
            f"no worker polls the work pool {pool.name} of {spec.deployment}: the cells wait until one starts "
            f"(`prefect worker start --pool {pool.name}`)"
        )
    return None


def missing_results(run_dir: Path, methods: list[str], seeds: list[int]) -> list[str]:
    """What a completed pipeline run of ``methods`` over ``seeds`` must hold in ``run_dir`` but does not,
    as relative paths (empty: all there): ``report/report.json`` and each (seed's) method's summary."""
    layout = RunLayout(run_dir)
    runs = [layout] if len(seeds) == 1 else [RunLayout(layout.seed_run(s)) for s in seeds]
    needed = [layout.report_json, *(sub.summary("pretrain", m) for sub in runs for m in methods)]
    return [p.relative_to(layout.root).as_posix() for p in needed if not p.is_file()]


def _first_difference(old: dict, new: dict) -> str:
    """The first dotted config key whose value differs, with both values ('' if none)."""
    from reports.common import flatten

    a, b = flatten(old, sep="."), flatten(new, sep=".")
    for key in dict.fromkeys([*a, *b]):
        if key not in a or key not in b:
            return key
        if a[key] != b[key]:
            return f"{key}: {a[key]!r} there, {b[key]!r} now"
    return ""


def _plan_cell(spec: SweepSpec, cell: Cell, cfg: ExperimentConfig, run_dir: Path) -> PlannedCell:
    """A cell's action: ``run`` in a new folder, ``skip`` a completed run of this config with its
    results, ``rerun`` anything else; a completed run of another config is refused."""
    digest = config_digest(cfg.model_dump(mode="json"))
    if not run_dir.exists():
        check_run_dir(run_dir)
        return PlannedCell(cell, cfg, run_dir, digest, "run")
    status = read_status(run_dir).get("status")
    if status != "completed":
        return PlannedCell(cell, cfg, run_dir, digest, "rerun", status or "no status")
    try:
        old = json.loads(RunLayout(run_dir).config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old = None
    new = cfg.model_dump(mode="json")
    if old != new:
        what = _first_difference(old, new) if isinstance(old, dict) else "config.json is missing or unreadable"
        raise ValueError(
            f"sweep {spec.name}, cell {cell.name}: {run_dir} holds a completed run of another config ({what}); "
            "give the sweep a new name or --sweep-dir, or delete that cell's folder to run it again"
        )
    missing = missing_results(run_dir, cfg.pretrain_methods, cfg.run_seeds)
    if missing:  # status.json vouches for results that are not there: run it again
        return PlannedCell(
            cell, cfg, run_dir, digest, "rerun", f"completed without its results (missing {', '.join(missing)})"
        )
    return PlannedCell(cell, cfg, run_dir, digest, "skip", status)


def sweep_preflight(spec: SweepSpec, sweep_dir: str | Path | None = None) -> SweepPlan:
    """Every check of a sweep: the Prefect server (:func:`check_deployment`), the sweep folder (new,
    empty or a sweep's), and each cell's config (:func:`check_config`, the corpus once per distinct data
    section) and run directory (:func:`_plan_cell`). Writes nothing. Raises ``ValueError``/``OSError``."""
    warning = check_deployment(spec)
    if sweep_dir is None:
        stamp = "" if spec.resume else dt.datetime.now(dt.UTC).strftime("-%Y%m%d-%H%M%S")
        sweep_dir = (Path(spec.sweep_root).expanduser() / f"{spec.name}{stamp}").absolute()
    if "://" in str(sweep_dir):
        raise ValueError(f"sweep folder {sweep_dir} is a URL; sweeps are written to a local folder: give a local path")
    path = Path(os.path.normpath(Path(sweep_dir).expanduser().absolute()))
    if path.exists() and not path.is_dir():
        raise ValueError(f"sweep folder {path} exists and is not a folder; choose another --sweep-dir")
    if inside := next((above for above in [path, *path.parents] if is_run(above)), None):
        raise ValueError(f"sweep folder {path} is inside the run directory {inside}; choose a path outside it")
    if path.is_dir() and any(path.iterdir()) and not SweepLayout(path).record.is_file():
        raise ValueError(
            f"sweep folder {path} is not empty and holds no {SWEEP_RECORD} (not a sweep); choose a new "
            "--sweep-dir or sweep name"
        )
    base_raw = read_base(spec.base, f"sweep {spec.name}")
    planned: list[PlannedCell] = []
    checked_data: set[str] = set()
    for cell in expand_cells(spec):
        cfg = cell_config(spec, cell, base_raw)
        data_key = json.dumps(cfg.data.model_dump(mode="json"), sort_keys=True)
        try:
            check_config(cfg, check_data=data_key not in checked_data)
        except (ValueError, OSError) as exc:
            raise _within(f"sweep {spec.name}, cell {cell.name}", exc) from None
        checked_data.add(data_key)
        planned.append(_plan_cell(spec, cell, cfg, SweepLayout(path).cell(cell.name)))
    return SweepPlan(spec, path, planned, [warning] if warning else [])


# -- a tuning study ------------------------------------------------------------------------------
# The spec fields a resumed study may change (never its objective): trials, compare, concurrency,
# from_base and where the study folder lies (a moved folder resumes).
MAY_CHANGE = ("trials", "compare", "concurrency", "from_base", "study_root")


@dataclass
class StudyPlan:
    """What a study will do: its folder and the base config's mapping (every trial starts from it)."""

    spec: TuneSpec
    study_dir: Path
    base: dict[str, Any]


def tune_preflight(spec: TuneSpec) -> StudyPlan:
    """Every check of a study: each searched value in a trial config of its method (the others at
    their first value), the tuned comparison's config, the corpus and devices (:func:`check_config`),
    and the study folder (new, empty, or a study of this spec up to :data:`MAY_CHANGE`). Writes
    nothing. Raises ``ValueError`` naming the study, key and value, or ``FileNotFoundError``."""
    where = f"study {spec.name}"
    raw = read_base(spec.base, where)
    first = {m: {k: r.values()[0] for k, r in spec.space[m].items()} for m in METHODS}
    for name, m, variant in spec.arms():
        for key, rng in spec.space[m].items():
            for value in rng.values():
                load_spec(
                    "config",
                    value=spec.trial_config(m, {**first[m], key: value}, raw, variant),
                    where=f"{where}, {name}: space.{m}.{key} = {value!r}",
                )
        trial = f"{where}, a {name} trial"
        cfg = load_spec("config", value=spec.trial_config(m, first[m], raw, variant), where=trial)
        try:
            check_config(cfg, check_data=name == "dp")
        except (ValueError, OSError) as exc:
            raise _within(trial, exc) from None
        if m == "diloco":
            load_spec(
                "config",
                value=spec.final_config(first["dp"], first["diloco"], raw, variant, name),
                where=f"{where}, the tuned comparison of {name}",
            )
    study_dir = spec.study_dir()
    record = StudyLayout(study_dir).record
    if record.exists():
        old = json.loads(record.read_text()).get("spec") or {}
        new = spec.model_dump(mode="json")
        differs = sorted(k for k in {*old, *new} if k not in MAY_CHANGE and old.get(k) != new.get(k))
        if differs:
            raise ValueError(
                f"{where}: {study_dir} holds a study of another spec ({', '.join(differs)} "
                "differ); give the study a new name or study_root, or delete that folder"
            )
    elif study_dir.exists() and any(study_dir.iterdir()):
        raise ValueError(
            f"{where}: {study_dir} exists and is not a study folder (no {record.name}); give "
            "the study a new name or study_root"
        )
    return StudyPlan(spec, study_dir, raw)


# -- fine-tuning a run's models ------------------------------------------------------------------
class FinetunePlan(dict):
    """What a fine-tuning run will do: ``cfg``, ``run_dir``, ``methods`` ({name: checkpoint or
    None}), ``replace``."""


def _is_prepared(p: Path) -> bool:
    return RunLayout(p).config.is_file() and RunLayout(p).manifest.is_file()


def _incomplete(ckpt: Path) -> str | None:
    """Why checkpoint folder ``ckpt`` has no step the loaders would restore (None: it has one)."""
    from training.ckpt_steps import complete_steps, step_folders

    if complete_steps(ckpt):
        return None
    found = ", ".join(step_folders(ckpt)[:3])
    return f"holds no complete checkpoint step ({f'only partial steps: {found}' if found else 'it is empty'})"


def _checkpoint_method(checkpoint: str, run_dir: str | None, name: str | None) -> tuple[str, dict]:
    """``--checkpoint``: an Orbax checkpoint folder of ours with a complete step, inside a run directory
    (``run_dir``, when given), and ``--name`` (default ``<method>-ckpt``) no other pretraining method's.
    Returns (its run directory, ``{name: checkpoint}``)."""
    ckpt = Path(checkpoint).expanduser().resolve()
    if not ckpt.is_dir():
        raise FileNotFoundError(
            f"--checkpoint {checkpoint} is not a folder; give an Orbax checkpoint folder "
            "(e.g. RUN/pretrain/dp/checkpoints)"
        )
    if ckpt.name.isdigit() and ((ckpt / "_CHECKPOINT_METADATA").exists() or (ckpt / "params").is_dir()):
        raise ValueError(
            f"--checkpoint {checkpoint} is one step of a checkpoint folder; give the folder that "
            f"holds the steps: {ckpt.parent}"
        )
    if problem := _incomplete(ckpt):
        raise FileNotFoundError(
            f"--checkpoint {checkpoint} {problem}; give a complete Orbax checkpoint folder such as "
            "RUN/pretrain/dp/checkpoints, or re-run pretraining for that method"
        )
    root = next((p for p in [ckpt, *ckpt.parents] if _is_prepared(p)), None)
    if root is None:
        raise ValueError(
            f"--checkpoint {checkpoint}: no run directory above it (a folder with config.json and "
            "data/manifest.json); give a checkpoint folder of one of our runs, e.g. RUN/pretrain/dp/checkpoints"
        )
    if run_dir and Path(run_dir).resolve() != root:
        raise ValueError(f"--checkpoint {checkpoint} belongs to {root}, not {run_dir}; give one of them")
    layout = RunLayout(root)
    pretrained = layout.methods("pretrain")
    # the report shows a method's fine-tuned figures beside its pretraining: another model's checkpoint
    # under that name would compare, e.g., DP with DP under DiLoCo's heading
    if name in {*METHOD_ORDER, *pretrained} and ckpt != Path(layout.checkpoints("pretrain", name)).resolve():
        why = (
            f"is this run's pretrained method (its checkpoint is {layout.checkpoints('pretrain', name)})"
            if name in pretrained
            else "is a pretraining method's name (the report would show this checkpoint as that method)"
        )
        raise ValueError(f"--name {name} {why}; pick another name")
    return str(root), {name or f"{ckpt.parent.name}-ckpt": str(ckpt)}


def _pretrained_methods(rd: Path, methods: list[str] | None) -> dict:
    """``{method: None}``: ``methods`` (default every pretrained one with a checkpoint), each complete."""
    layout = RunLayout(rd)
    have = [m for m in layout.methods("pretrain") if layout.checkpoints("pretrain", m).is_dir()]
    chosen = methods or have
    missing = [m for m in chosen if m not in have]
    if missing:
        raise FileNotFoundError(
            f"{rd} has no pretrained checkpoint of {missing[0]} (has: {', '.join(have) or 'none'}); pick from those"
        )
    if not chosen:
        raise FileNotFoundError(f"{rd} holds no pretrained checkpoint yet; pretrain first (`ddiloco run`)")
    problems = {m: _incomplete(layout.checkpoints("pretrain", m)) for m in chosen}
    usable = [m for m, p in problems.items() if p is None]
    for m, problem in problems.items():
        if problem:  # the loader would refuse it only after the data step and the server
            raise FileNotFoundError(
                f"{rd}: the pretrained checkpoint of {m} ({layout.checkpoints('pretrain', m)}) {problem}; "
                f"re-run pretraining of {m}"
                + (f", or fine-tune the others alone with --methods {','.join(usable)}" if usable else "")
            )
    return {m: None for m in chosen}


def finetune_preflight(
    run_dir: str | None,
    methods: list[str] | None = None,
    checkpoint: str | None = None,
    name: str | None = None,
    overrides: dict[str, Any] | None = None,
    replace: bool = False,
) -> FinetunePlan:
    """Check everything a fine-tuning run needs (arguments as :func:`flows.finetune.finetune`), write
    nothing; return the plan. Every other method's results must come from the same recipe
    (``training.finetune.finetune_record``): a run directory compares its methods under one. Raises
    ``ValueError`` / ``FileNotFoundError`` / ``FileExistsError`` naming the argument and the fix."""
    overrides = dict(overrides or {})
    bad = [k for k in overrides if not str(k).startswith("finetune.")]
    if bad:
        raise ValueError(f"--set {bad[0]}: only finetune.* fields can change after pretraining")
    if "finetune.enabled" in overrides:
        raise ValueError(
            "--set finetune.enabled: `ddiloco finetune` always fine-tunes; the field switches the "
            "pipeline's stage (ddiloco run)"
        )
    if name and not checkpoint:
        raise ValueError("--name names the results of --checkpoint; give both, or neither")
    if checkpoint and methods:
        raise ValueError("give --checkpoint or --methods, not both")
    if checkpoint:
        run_dir, plan = _checkpoint_method(checkpoint, run_dir, name)
    if not run_dir:
        raise ValueError("give a run directory (or --checkpoint)")
    rd = Path(run_dir)
    layout = RunLayout(rd)
    if not _is_prepared(rd):
        raise FileNotFoundError(
            f"{rd} is not a run directory with prepared data (config.json and data/manifest.json); "
            "give a directory made by `ddiloco run`"
        )
    raw = apply_overrides(json.loads(layout.config.read_text()), {"finetune.enabled": True})
    cfg = load_spec("config", value=raw, sets=overrides, where="invalid fine-tuning settings")
    if not checkpoint:
        plan = _pretrained_methods(rd, methods)
    from training.finetune import finetune_record

    for m in plan:
        layout.method_dir("finetune", m)  # a valid method name
        if layout.holds_results("finetune", m) and not replace:
            raise FileExistsError(
                f"{rd} already holds fine-tuning results of {m}; pass --replace to fine-tune it "
                "again (its earlier results are deleted once the new ones are written)"
                + (", or another --name" if checkpoint else "")
            )
    recipe = finetune_record(cfg.finetune, cfg.seed)
    for m in layout.methods("finetune"):
        if m in plan or not layout.summary("finetune", m).is_file():
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

    check_lora_targets(cfg.finetune, cfg.model, input_shape(cfg.data, load_manifest(rd)))
    if cfg.finetune_task == "speakers" and not (layout.data / "heldout_finetune.jsonl").is_file():
        raise ValueError(
            f"{rd} was prepared with data.finetune_docs: 0, so no play was held out for the speakers task; "
            "use --set finetune.source=jsonl with finetune.paths, or a new run with data.finetune_docs"
        )
    check_finetune_inputs(cfg.finetune, cfg.finetune_task, cfg.data.seed)
    return FinetunePlan(cfg=cfg, run_dir=rd, methods=plan, replace=replace)
