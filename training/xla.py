"""Process-wide host settings for running XLA:CPU training steps: one idempotent call.

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
import sys
import threading

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
