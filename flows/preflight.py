"""Every check that can run before Prefect and JAX start, in one place.

``ddiloco run`` calls :func:`preflight` before it starts Prefect; the pipeline flow calls it again
first thing (a run started from the UI never went through the CLI). It writes nothing: the run
directory is created only after every check has passed.
"""

from __future__ import annotations

import os
from pathlib import Path

from configs.schema import ExperimentConfig, validate_against_model
from run.directory import check_run_dir, default_run_dir
from run.layout import RunLayout

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


def check_local_paths(cfg: ExperimentConfig) -> None:
    """Local corpus files exist and have a supported suffix (cheap; no file is read)."""
    if cfg.data.source != "local":
        return
    for path in cfg.data.paths:
        p = Path(path).expanduser()
        if p.is_dir():
            raise ValueError(f"data.paths: {path} is a folder; list the files in it")
        if not p.is_file():
            raise FileNotFoundError(f"data.paths: file not found: {path}")
        if not p.name.lower().endswith(LOCAL_SUFFIXES):
            raise ValueError(f"data.paths: {path} is not one of {', '.join(LOCAL_SUFFIXES)}")


def check_reusable_data(cfg: ExperimentConfig, path: Path) -> None:
    """A run directory that already holds ``data/`` (an earlier run's, that never trained) is used
    only when that data was built from this config's data section and learner count.
    Raises ``ValueError`` naming the folder and the fix."""
    data = RunLayout(path).data
    if not data.exists() and not data.is_symlink():
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
    if old != config_record(cfg):
        raise ValueError(
            f"run directory {path} holds data built from another data config or learner count; choose a new --run-dir"
        )


def check_model(cfg: ExperimentConfig, shape=None) -> int:
    """Build the model abstractly (shapes only, no compute) and check P against its tensors.
    ``shape``: the data's ``InputShape`` when known (an image folder's, from its headers).

    Returns the number of parameter tensors. Raises ``ValueError`` naming ``diloco.fragments``.
    """
    from flax import nnx

    from models import InputShape, build_model
    from training.functional import params_of

    if shape is None and cfg.data.modality == "image":
        shape = _known_image_shape(cfg)
        if shape is None:  # known only once the images are read (the shard step checks it then)
            return 0
    elif shape is None:
        shape = InputShape(vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len)
    try:
        spec = build_model(cfg.model, shape)
    except ValueError as exc:  # e.g. a patch size that does not divide the images
        raise ValueError(f"model ({cfg.model.kind}) does not fit the data: {exc}") from None
    n = len(params_of(nnx.eval_shape(lambda: spec.init(0))))
    validate_against_model(cfg, n)
    return n


def _known_image_shape(cfg: ExperimentConfig):
    """The images' InputShape when it is known before reading them: digits (8×8 grey, 10 classes,
    pixels 0-16); else None."""
    from models import InputShape

    if cfg.data.source == "digits":
        return InputShape(image_shape=(8, 8, cfg.data.channels or 1), num_classes=10, pixel_max=16)
    return None


DIGITS_IMAGES = 1797  # scikit-learn's load_digits


def check_image_source(cfg: ExperimentConfig) -> None:
    """Cheap checks of an image source: an imagefolder is laid out as class folders, optionally below
    split folders (``data.images.scan_image_folder``), every image's header is readable and, without
    ``data.image_size``, all have one size (``data.images.inspect_image_folder``), and the model fits
    the images' shape; a hub dataset is reachable; where the image count is known before reading
    (digits, an imagefolder), the validation split holds at least one held-out batch. Raises
    ``ValueError``/``FileNotFoundError``/``ConnectionError`` in one line."""
    d = cfg.data
    count = DIGITS_IMAGES if d.source == "digits" else None
    if d.source == "imagefolder":
        from data.images import inspect_image_folder, scan_image_folder
        from models import InputShape

        folder = scan_image_folder(d.paths[0])
        for split in ("val", "test"):
            field = f"{split}_fraction"
            if split in folder.files and getattr(d, field) != type(d).model_fields[field].default:
                raise ValueError(
                    f"data.{field}: {d.paths[0]} has a {split} split folder, which is the {split} split "
                    f"as is; remove data.{field}"
                )
        found = inspect_image_folder(folder, d.image_size, d.channels)
        shape = InputShape(image_shape=found["image_shape"], num_classes=found["num_classes"], pixel_max=255)
        check_model(cfg, shape)
        check_lora_targets(cfg, shape)
        import numpy as np

        from data.images import ImageSet, complete_splits

        labels, given = folder.labels_and_splits()  # the data step's exact split, from the file list
        splits, source = complete_splits(
            ImageSet(np.empty(0), labels, folder.classes, 255, {}, given), d.val_fraction, d.test_fraction, d.seed
        )
        if len(splits["val"]) < cfg.train.eval_batch_size:
            where = (
                f"the val split folder of {d.paths[0]}"
                if source["val"] == "folder"
                else f"data.val_fraction ({d.val_fraction}) of the "
                f"{len(labels) if given is None else len(given['train'])} "
                f"{'images' if given is None else 'train/ images'}"
            )
            raise ValueError(
                f"{where} holds {len(splits['val'])} validation images, fewer than train.eval_batch_size "
                f"({cfg.train.eval_batch_size}) for one held-out batch; "
                f"{'add validation images' if source['val'] == 'folder' else 'raise data.val_fraction'} "
                "or lower train.eval_batch_size"
            )
    if count is not None:
        val = int(count * d.val_fraction)  # the stratified split rounds per class, give or take a few
        if val < cfg.train.eval_batch_size:
            raise ValueError(
                f"data.val_fraction ({d.val_fraction}) of {count} images holds about {val} validation images, "
                f"fewer than train.eval_batch_size ({cfg.train.eval_batch_size}) for one held-out batch; raise "
                "data.val_fraction or lower train.eval_batch_size"
            )
    if d.source == "hf_images":
        from data.sources import check_hf_reachable

        check_hf_reachable(
            d.hf_name,
            "use data.source: digits (bundled) or imagefolder with data.paths: [a folder of class sub-folders] instead",
        )


def check_finetune_inputs(cfg: ExperimentConfig) -> None:
    """The fine-tuning task's own inputs, when the run fine-tunes: the user's JSONL pairs are read and
    checked (fields, empty files), a hub dataset is reachable. Raises ``ValueError`` /
    ``FileNotFoundError`` / ``ConnectionError`` in one line."""
    ft = cfg.finetune
    task = cfg.finetune_task
    if task == "jsonl":
        from data.finetune import MIN_TEST_ITEMS, MIN_TRAIN_ITEMS, load_jsonl_pair_files, split_items

        pairs = load_jsonl_pair_files(ft.paths, ft.prompt_field, ft.response_field)  # (ids checked across files)
        counts = [len(p) for p in pairs if p is not None]
        if len(counts) == 1:
            train, test = map(len, split_items(counts[0], ft.test_fraction, cfg.data.seed))
        else:
            train, test = counts
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


def check_lora_targets(cfg: ExperimentConfig, shape=None) -> None:
    """With ``finetune.mode: lora``, every name of ``finetune.lora_targets`` is a projection of the
    model (built abstractly, no compute) and the rank is below each one's smaller side. Raises
    ``ValueError`` naming the field. ``shape``: the data's ``InputShape`` when known (else the one
    the config implies; images of unknown shape are checked once the data exists)."""
    if cfg.finetune.mode != "lora":
        return
    from flax import nnx

    from models import InputShape, build_model
    from models.layers.lora import linear_layers

    if shape is None:
        shape = (
            _known_image_shape(cfg)
            if cfg.data.modality == "image"
            else InputShape(vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len)
        )
    if shape is None:
        return
    layers = linear_layers(nnx.eval_shape(lambda: build_model(cfg.model, shape).init(0)))
    names = {n for n, _ in layers.values()}
    missing = [t for t in cfg.finetune.lora_targets if t not in names]
    if missing:
        raise ValueError(
            f"finetune.lora_targets: {missing[0]!r} is no projection of a {cfg.model.kind} model; its "
            f"projections are {', '.join(sorted(names))}"
        )
    small = min(min(io) for n, io in layers.values() if n in cfg.finetune.lora_targets)
    if cfg.finetune.lora_rank >= small:
        raise ValueError(
            f"finetune.lora_rank ({cfg.finetune.lora_rank}) must be below the smallest adapted "
            f"projection's side ({small})"
        )


# Where an s3:// exchange's credentials come from: the environment of every process (never a config,
# a log or a report), as botocore reads them.
S3_CREDENTIALS = (
    "the credentials in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE; "
    "AWS_ENDPOINT_URL_S3 for an S3-compatible server)"
)


def check_runtime(cfg: ExperimentConfig) -> None:
    """The engine and the exchange, before anything starts: the fsspec exchange URL is of a form the
    exchange can use (no chained URL), its protocol has an implementation installed here, its root
    can be created and a probe object written, read and deleted there
    (``diloco.exchange.fsspec.check_writable``: folders it created are removed again), and an
    existing cluster's address answers (a TCP connect, 5 s); a ``runtime.compilation_cache`` folder
    can be created and written the same way.

    Raises ``ValueError`` (naming ``runtime.exchange_url``: the form, the package to install, or
    what failed when writing; or ``runtime.compilation_cache``) or ``ConnectionError`` (naming
    ``runtime.address``)."""
    rt = cfg.runtime
    if rt.exchange_kind == "fsspec" and rt.exchange_url:
        import fsspec

        from training.exchange_checks import check_url, check_writable  # no JAX

        try:
            check_url(rt.exchange_url)
        except ValueError as exc:
            raise ValueError(f"runtime.exchange_url {exc}") from None
        protocol = rt.exchange_url.split("://", 1)[0] if "://" in rt.exchange_url else "file"
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            raise ValueError(
                f"runtime.exchange_url {rt.exchange_url}: no fsspec implementation of {protocol}:// "
                f"here ({str(exc).splitlines()[0]}); install it (`uv sync --extra s3` for s3://, gcsfs for "
                "gs://) or use a shared folder"
            ) from None
        try:
            check_writable(rt.exchange_url)
        except Exception as exc:  # whatever the filesystem raises (OSError, NotImplementedError, its own)
            first = (str(exc).strip().splitlines() or [""])[0]
            where = (
                f"give a prefix of an existing bucket that {S3_CREDENTIALS} can write"
                if protocol in ("s3", "s3a")
                else "give a folder or bucket prefix this user can write and every worker can reach"
            )
            raise ValueError(
                f"runtime.exchange_url {rt.exchange_url}: cannot be created or written here "
                f"({type(exc).__name__}: {first}); {where}, or unset it (the exchange then lives in the "
                "run directory)"
            ) from None
    if rt.compilation_cache not in (None, "run"):
        from training.exchange_checks import check_writable  # no JAX

        folder = str(Path(rt.compilation_cache).expanduser().absolute())
        try:
            check_writable(folder)
        except Exception as exc:  # whatever the filesystem raises
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ValueError(
                f"runtime.compilation_cache {rt.compilation_cache}: cannot be created or written here "
                f"({type(exc).__name__}: {first}); give a folder this user can write, or run (the run "
                "directory's cache/xla), or off"
            ) from None
    if rt.address and rt.address != "auto":
        import socket
        from urllib.parse import urlsplit

        url = urlsplit(rt.address if "://" in rt.address else f"tcp://{rt.address}")
        if not url.hostname or not url.port:
            raise ValueError(
                f"runtime.address {rt.address}: give host and port, e.g. "
                f"{'head:6379' if rt.engine == 'ray' else 'tcp://scheduler:8786'}"
            )
        try:
            socket.create_connection((url.hostname, url.port), timeout=5).close()
        except OSError as exc:
            raise ConnectionError(
                f"runtime.address {rt.address}: nothing answers there ({exc}); start the "
                f"{rt.engine} cluster first or unset runtime.address for a local one"
            ) from None
        if rt.engine == "ray" and "://" not in rt.address:
            check_ray_authentication(rt.address)


def check_network(cfg: ExperimentConfig) -> None:
    """``network.emulate`` can run here: root, iproute2 and util-linux, network namespaces allowed
    (``run.netem.emulation_problem``), and moto's S3 server installed for DiLoCo's exchange. Raises
    ``ValueError`` naming ``network.emulate`` and the fix."""
    if not cfg.network.emulate:
        return
    import sys

    from run.netem import emulation_problem

    problem = emulation_problem()
    if problem:
        raise ValueError(problem)
    if cfg.diloco.enabled and not (Path(sys.executable).parent / "moto_server").exists():
        raise ValueError(
            "network.emulate puts DiLoCo's exchange on moto's S3 server, which is not installed here: "
            "uv sync --extra emulate (make setup installs it)"
        )


def check_ray_authentication(address: str) -> None:
    """A Ray cluster's GCS at ``address`` (host:port) accepts this process's authentication: Ray 2.60's
    ``ray start`` turns token authentication on, and a run without the cluster's token in its
    environment would otherwise fail only when it connects, after ~50 s of retries and after its run
    directory was set up. One connection of Ray's GCS client (no driver is started; about a second,
    most of it importing Ray). Raises ``ConnectionError`` naming ``runtime.address`` and the variables
    to set when the cluster refuses the token (or its absence); anything else is left to the run."""
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


def check_tracking(cfg: ExperimentConfig) -> None:
    """``tracking.wandb: true`` needs the wandb package here (looked up, not imported). Raises
    ``ValueError`` naming the field and how to install it or turn it off."""
    import importlib.util

    if cfg.tracking.wandb and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            "tracking.wandb: true needs the wandb package, which is not installed here: "
            "`uv sync --extra wandb` (or pip install wandb), or set tracking.wandb: false"
        )


def preflight(cfg: ExperimentConfig, run_dir: str | Path | None = None, check_data: bool = True) -> Path:
    """Check the run directory, the corpus and the model; return the run directory to use.

    Order: the run directory (``run.directory.check_run_dir``; ``<run_root>/<name>-<time>`` when
    ``run_dir`` is None), then :func:`check_config`. Nothing is written anywhere but the corpus
    download cache.

    Raises ``ValueError``, ``FileNotFoundError`` or ``ConnectionError`` with one line naming the
    field or path and the fix.
    """
    path = check_run_dir(run_dir if run_dir is not None else default_run_dir(cfg.run_root, cfg.name))
    check_reusable_data(cfg, path)
    check_config(cfg, check_data)
    return path


def learner_device_pool(cfg: ExperimentConfig) -> tuple[list, str] | None:
    """The devices each learner's process will see, where that is known before the run starts, and
    how to name their owner: this process's (thread engine); a local Dask cluster's workers inherit
    this process's environment, so its devices; a local Ray instance's learner gets the GPUs it asks
    for (``flows.engines.learner_gpus`` on this host's GPUs: ``ValueError`` naming
    ``runtime.learner_gpus`` when an explicit request exceeds them), or on a host without GPUs this
    process's CPU devices. None where it cannot be known in advance: the workers of an existing
    cluster (``runtime.address``), and a CPU learner of Ray on a GPU host (which devices JAX sees in
    a Ray worker with no GPU reserved is Ray's setting). There a learner that cannot meet the request
    fails before its first step, and the DiLoCo stage fails with the reason. Starts JAX's backend."""
    import jax

    rt = cfg.runtime
    devices = jax.devices()
    if rt.engine == "threads":
        return devices, "this process"
    if rt.address is not None:
        return None
    if rt.engine == "dask":
        return devices, "each worker of the local Dask cluster (they start with this process's devices)"
    from flows.engines import learner_gpus

    gpus = [d for d in devices if d.platform == "gpu"]
    g = learner_gpus(cfg, len(gpus))
    if g:
        return gpus[:g], f"each learner's Ray task (its {g} GPU(s): runtime.learner_gpus)"
    if gpus:
        return None
    return devices, "each worker of the local Ray instance (they start with this process's devices)"


def check_devices(cfg: ExperimentConfig) -> None:
    """``runtime.devices_per_learner`` against the devices each learner's process will have, where
    known before the run (:func:`learner_device_pool`: the thread engine's, a local Dask or Ray
    cluster's; not an existing cluster's), and (DP enabled) the DP batch and microbatch against this
    process's devices, times ``dp.hosts`` (``training.mesh.learner_devices``, ``training.dp.dp_devices``). Asks JAX for
    its devices, which starts its backend. Raises ``ValueError`` naming the field
    (``runtime.devices_per_learner``, ``runtime.learner_gpus``, ``dp.batch_size``), the device count
    and the fix."""
    from training.dp import dp_devices
    from training.mesh import learner_devices

    known = learner_device_pool(cfg)
    if known is not None:
        learner_devices(0, cfg.runtime.devices_per_learner, known[0], where=known[1])
    if cfg.dp.enabled:
        import jax

        dp_devices(cfg, jax.devices() * cfg.dp.hosts)  # each host process as many devices as this one


def check_config(cfg: ExperimentConfig, check_data: bool = True) -> None:
    """Every check of a config that needs no run directory: local file paths, the runtime, W&B
    when ``tracking.wandb`` (:func:`check_tracking`), the model's tensors against
    ``diloco.fragments``, the devices (:func:`check_devices`), the fine-tuning inputs, then the corpus
    itself (``data.sources.check_corpus``: encodings, empty or too few documents, a reachable hub
    dataset) unless ``check_data`` is False. Raises like :func:`preflight`."""
    check_local_paths(cfg)
    check_runtime(cfg)
    check_network(cfg)
    check_tracking(cfg)
    check_model(cfg)
    check_devices(cfg)
    if cfg.finetune.enabled:
        check_finetune_inputs(cfg)
        check_lora_targets(cfg)
    if check_data and cfg.data.modality == "image":
        check_image_source(cfg)
    elif check_data:
        from data.sources import check_corpus

        check_corpus(cfg.data)
