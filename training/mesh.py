"""Device meshes: data parallelism inside one learner (or the DP baseline) through ``jax.sharding``.

A Decoupled DiLoCo learner owns ``runtime.devices_per_learner`` devices (d) and runs data-parallel
inside them: a one-axis :class:`jax.sharding.Mesh` named ``"batch"`` over its devices, parameters
and optimizer state replicated on every device, each batch split along its leading axis into d
equal blocks of rows (block i on the mesh's i-th device), and the gradient averaged by XLA (the
jitted step declares its input and output shardings; ``training.step``). The DP baseline does the
same over every device of the process.

Learner m gets devices ``[m·d, (m+1)·d)`` of the process's devices; with fewer than M·d devices
the slices wrap round, so learners then share devices (threads of one process take turns on them;
on CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX starts gives N devices).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

BATCH = "batch"  # the mesh's one axis: the batch's leading (row) axis is split over it


def learner_devices(
    learner: int, per_learner: int, devices: Sequence[Any] | None = None, where: str = "this process"
) -> list[Any]:
    """The devices learner ``learner`` (m ≥ 0) trains on: ``per_learner`` (d) consecutive devices.

    ``devices``: the pool, in order (default ``jax.devices()``); any objects, so tests can pass
    stand-ins. Returns ``devices[(m·d + i) mod n]`` for i in 0..d−1 (n = ``len(devices)``): disjoint
    slices for learners m < n / d, then the same slices again (learners share devices).

    Raises ``ValueError`` naming ``runtime.devices_per_learner`` when d exceeds n or does not divide
    n (the slices would straddle the wrap-round), and for m < 0 or d < 1; ``where`` names the pool's
    owner in the message (a preflight checks another process's pool: ``flows.preflight.check_devices``).
    """
    if learner < 0:
        raise ValueError(f"learner index must be ≥ 0, got {learner}")
    if per_learner < 1:
        raise ValueError(f"runtime.devices_per_learner must be ≥ 1, got {per_learner}")
    pool = list(jax.devices() if devices is None else devices)
    n = len(pool)
    if per_learner > n:
        raise ValueError(
            f"runtime.devices_per_learner ({per_learner}) exceeds the {n} device(s) of {where}; "
            f"lower it to at most {n} (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
            "before JAX starts gives N devices)"
        )
    if n % per_learner:
        fits = [k for k in range(1, n + 1) if n % k == 0]
        raise ValueError(
            f"runtime.devices_per_learner ({per_learner}) must divide the {n} devices of {where} "
            f"(learners take equal, whole slices); pick one of {fits}"
        )
    start = (learner * per_learner) % n
    return pool[start : start + per_learner]


def batch_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A one-axis mesh named ``"batch"`` over ``devices`` (in the order given: device i holds the
    i-th block of each batch's rows). Raises ``ValueError`` for an empty sequence or a repeated device."""
    devices = list(devices)
    if not devices:
        raise ValueError("a batch mesh needs at least one device")
    if len(set(devices)) != len(devices):
        raise ValueError(f"a batch mesh needs distinct devices, got {devices}")
    return Mesh(np.array(devices, dtype=object), (BATCH,))


def replicated(mesh: Mesh) -> NamedSharding:
    """A whole copy of an array on every device of ``mesh`` (parameters, optimizer state, metrics)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """An array's leading axis split into ``mesh.size`` equal, contiguous blocks, block i on the
    mesh's i-th device (a batch ``[B, ...]``: B / size rows each; B must be divisible by the size)."""
    return NamedSharding(mesh, PartitionSpec(BATCH))


def single_default(devices: Sequence[jax.Device] | None) -> bool:
    """True for no devices or just the process's default device (``jax.devices()[0]``, where
    uncommitted arrays live): the step then runs as it always has, with no placement."""
    return devices is None or list(devices) == jax.devices()[:1]


def place(tree: Any, sharding: Sharding) -> Any:
    """``tree`` with every leaf committed to ``sharding``: leaves already there are returned as they
    are, others (host numpy, uncommitted arrays, arrays committed elsewhere) put there with
    ``jax.device_put``. (Committed and uncommitted inputs are different signatures to ``jax.jit``:
    a mix of them, e.g. freshly pulled fragments beside stepped parameters, compiles again.) Use it
    before a call whose input shardings are fixed: ``jax.jit`` refuses an argument committed to
    another sharding."""

    def put(x):
        if isinstance(x, jax.Array) and x.sharding == sharding and x.committed:
            return x
        return jax.device_put(x, sharding)

    return jax.tree.map(put, tree)


def device_sharding(device: jax.Device) -> SingleDeviceSharding:
    """Everything on one device (a learner whose slice is one device other than the default)."""
    return SingleDeviceSharding(device)


def backend_info() -> dict[str, Any]:
    """What this process computes on: ``backend`` (``jax.default_backend()``: cpu, gpu, tpu),
    ``devices`` (how many), ``device_kind`` (the first device's, e.g. ``NVIDIA H200`` or ``cpu``),
    ``jax`` (its version). Starts JAX's backend if it has not started."""
    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "jax": jax.__version__,
    }


def backend_line(info: dict[str, Any] | None = None) -> str:
    """:func:`backend_info` in one line: ``gpu: 8 × NVIDIA H200 (jax 0.10.2)``."""
    info = info or backend_info()
    return f"{info['backend']}: {info['devices']} × {info['device_kind']} (jax {info['jax']})"
