"""Process-wide host settings for running XLA:CPU training steps: one idempotent call; and JAX's
persistent compilation cache (:func:`use_compilation_cache`).

:func:`configure_host` is called by ``training.step.make_train_step`` and ``make_eval_step``, so
every process that builds a step (``ddiloco run``'s flows and tasks, the tests, the benchmarks)
has it before its first step runs; an entry point may call it earlier, it is harmless twice.

What it sets, and why (measured with ``benchmarks/throughput.py`` and ``resource.getrusage``
page-fault counts on the 2-core CPU, default config):

* **glibc malloc keeps freed memory.** XLA:CPU allocates each execution's temporary buffer anew
  (the activations: 37 MiB for a microbatched learner or DP step of the default model). glibc
  serves blocks above ``M_MMAP_THRESHOLD`` (128 KiB, rising to at most 32 MiB) with fresh
  ``mmap`` pages and unmaps them on ``free``, so every step page-faulted its whole working set in
  again: ~16,000 minor faults per learner step, and the first microbatch of each step ran ~15 ms
  slower than the others. Raising ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` to 1 GiB keeps
  the memory in malloc's heaps for the next step: a few hundred faults per step, the learner step
  ≈ 85 → ≈ 63 ms and the DP step ≈ 270 → ≈ 250 ms (microbatches of 4; three alternating runs
  each). The price: the process keeps its peak heap instead of returning it to the OS.
  Limit: the buffer is allocated on JAX's dispatch thread, whose malloc arena grows in heaps of at
  most 64 MiB, so a larger one — the whole-batch steps' 66 MiB (learner) and 260 MiB (DP) — is
  still mapped afresh per call (~17,000 and ~70,000 faults per step). With
  ``jax_cpu_enable_async_dispatch=False`` it lands in the calling thread's heap instead (DP whole
  batch 323 → 238 ms); that is not set here: every caller would then wait for its step, and the
  microbatched learner step measured no faster with it. Linux with glibc only; elsewhere nothing
  is done.

XLA flags (``XLA_FLAGS``) were measured too and none is set: disabling or narrowing the YNNPACK
fusions (``--xla_cpu_experimental_ynn_fusion_type``) cost 3–9 %, a 512-bit vector width and
fast math gained ≤ 3 % (fast math also changes the numerics), and oneDNN's dot fusions
(``--xla_cpu_use_onednn``) aborted the process on this model.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30

_lock = threading.Lock()
_configured: bool | None = None


def configure_host() -> bool:
    """Apply the settings above once per process; True if the allocator settings took effect."""
    global _configured
    with _lock:
        if _configured is None:
            _configured = _keep_freed_memory()
        return _configured


def _keep_freed_memory() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))


# For a run's own cache folder (the environment's JAX_COMPILATION_CACHE_DIR keeps the environment's
# settings): compiles shorter than this are not written (eager ops' kernels and the like, cheaper
# to compile again than to read back; the default model's steps take 1-3 s).
CACHE_MIN_COMPILE_S = 0.1
# Bounded, so that a shared folder cannot grow without end; a bound also makes JAX take a file lock
# around every read and write of the folder (jax/_src/lru_cache.py), so processes writing the same
# entry at once never read half a file. Every process using the folder must then be bounded too
# (JAX's eviction expects each entry's access-time file), which these runs' processes are.
CACHE_MAX_BYTES = 2 << 30
_UNSET = object()
_cache_dir: object = _UNSET  # the folder this process set (str), None (off), or not yet set


def use_compilation_cache(path: str | os.PathLike | None) -> str | None:
    """Process-wide: read and write compiled executables in JAX's persistent compilation cache at
    ``path`` (a local folder, created if missing), or turn the cache off (None), whatever
    ``JAX_COMPILATION_CACHE_DIR`` says. Idempotent; a different folder than this process's current
    one resets JAX's cache handle first. Thread-safe.

    Every process that compiles the same step (learner processes of the Ray and Dask engines, a
    retried learner, the fine-tuning seeds, the evaluations) then compiles it once between them:
    on 2 CPU cores the default model's learner step took 2.0 s to compile and 0.8 s to load, its
    parameter initialisation 2.9 s and 1.1-1.5 s (``benchmarks/engines.py`` has the start-up
    figures). Entries are keyed by the computation, JAX/XLA versions and backend, so a shared
    folder never serves a stale executable. Returns the folder in use (str) or None."""
    global _cache_dir
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    want = None if path is None else str(Path(path).expanduser().absolute())
    with _lock:
        if want == _cache_dir:
            return want
        compilation_cache.reset_cache()
        if want is not None:
            Path(want).mkdir(parents=True, exist_ok=True)
            env_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR")
            if env_dir and str(Path(env_dir).expanduser().absolute()) == want:
                # the environment's cache: its settings as the environment gives them (JAX's own
                # defaults otherwise), like any other process that uses that folder; a folder
                # written with and without a size bound at once breaks JAX's eviction
                min_s = float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 1.0))
                max_bytes = int(os.environ.get("JAX_COMPILATION_CACHE_MAX_SIZE", -1))
            else:
                min_s, max_bytes = CACHE_MIN_COMPILE_S, CACHE_MAX_BYTES
            jax.config.update("jax_persistent_cache_min_compile_time_secs", min_s)
            jax.config.update("jax_compilation_cache_max_size", max_bytes)
        jax.config.update("jax_compilation_cache_dir", want)
        jax.config.update("jax_enable_compilation_cache", want is not None)
        _cache_dir = want
        return want
