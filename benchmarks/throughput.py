"""Training-step speed of our JAX step against PyTorch at the same shape, side by side in one run.

    python benchmarks/throughput.py [--config configs/default.yaml] [--repeats 11]
    python benchmarks/throughput.py --families [--repeats 11]   # every model family, ours alone
    make bench-torch        # installs the optional PyTorch reference first, then runs this

``--families``: the learner and DP steps of every shipped family's config (``default`` dense LM,
``moe`` MoE LM, ``vit``, ``vit_moe``) as configured (microbatches included), in budget units per
second (tokens or images) and MFU from the spec's FLOPs per unit (active FLOPs for MoE: router and
k experts; the dispatch/combine einsums are overhead, not counted) against the same measured peak;
the step kinds take turns as below.

Four steps, as the pipeline runs them: the DiLoCo learner step (``diloco.batch_size`` rows) and the
DP step (``dp.batch_size`` rows), each on the whole batch and split into the configured
microbatches (``train.microbatch_size``; gradients averaged before the one update). Ours is
``training.step.Trainer`` on ``models.build_model`` with the configured AdamW; PyTorch's is
``benchmarks/torch_reference.py``: the same model, parameter count (checked), optimizer and
microbatching, eager, ``torch.set_num_threads`` = the cores this process may use.

Timing: the eight step kinds (4 × ours, 4 × PyTorch) take turns within each repetition, so a
load that comes and goes on a shared machine falls on all of them. A turn is one untimed step
(the other library's threads wind down meanwhile), then ``STEPS`` steps back to back, timed until
every output is ready, as the training loops run them (they read the loss only when they log).
Figures are medians over ``--repeats`` turns, after compilation and two warm-up steps. Both
libraries run under ``training.xla.configure_host`` (malloc keeps freed memory).

``ratio`` = PyTorch ms / our ms (> 1: ours is faster). MFU = model FLOP/s ÷ peak FLOP/s, with
model FLOPs per token from ``models.text.dense.flops_per_token`` (6·N_matmul + 12·n_layers·d·L).
The peak is measured in the same run: the best float32 FLOP/s of a 2048² matmul, JAX and
PyTorch, best of 10 each; the higher of the two is the peak used. Prints a table; asserts nothing
but the parameter count. Without PyTorch it says so in one line and prints our figures alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax
import jax.numpy as jnp
import numpy as np

from configs.specs import load_spec
from models import build_model
from models.spec import InputShape
from models.text.dense import flops_per_token
from training.optimizers import make_inner_tx
from training.step import Trainer
from training.xla import configure_host

try:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from torch_reference import TorchTrainer, cores, count_params as torch_params
except ImportError:  # the optional reference: `make bench-torch` installs it
    torch = None

PEAK_N = 2048
STEPS = 2  # timed back-to-back steps per turn


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def jax_matmul_flops(n: int = PEAK_N, reps: int = 10, dtype=jnp.float32) -> float:
    """Best FLOP/s of an n×n ``dtype`` matmul over ``reps`` calls (after one to compile)."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def torch_matmul_flops(n: int = PEAK_N, reps: int = 10) -> float:
    a = torch.from_numpy(np.random.default_rng(0).standard_normal((n, n), np.float32))
    a @ a
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def ours(spec, tx, batch: np.ndarray, microbatches: int, precision=None) -> Callable[[int], float]:
    """``steps(n)``: n steps of our compiled step (params and state carried, donated), every output
    ready at the end; last loss. ``precision``: a ``configs.runtime.PrecisionConfig`` (None: float32)."""
    trainer = Trainer(spec, tx, microbatches, precision=precision)
    params = trainer.init_params()
    state = [params, trainer.init_opt(params)]
    batch = jax.tree.map(jnp.asarray, batch)

    def steps(n: int) -> float:
        for _ in range(n):
            state[0], state[1], metrics = trainer.step(state[0], state[1], batch)
        jax.block_until_ready((state[0], state[1], metrics))
        return float(metrics["loss"])

    return steps


def theirs(cfg, batch: np.ndarray, microbatches: int, vocab: int) -> Callable[[int], float]:
    trainer = TorchTrainer(cfg.model, cfg.diloco.inner, vocab, cfg.data.seq_len, microbatches)
    rows = torch.from_numpy(batch.astype(np.int64))

    def steps(n: int) -> float:
        for _ in range(n):
            loss = trainer.step(rows)
        return float(loss)

    return steps


FAMILY_CONFIGS = ("default", "moe", "vit", "vit_moe")


def family_batch(cfg, rows: int, rng) -> object:
    """A random batch of ``rows`` rows for ``cfg``'s data: token ids, or digits-like images and labels."""
    if cfg.data.modality == "image":
        return {
            "image": rng.integers(0, 17, (rows, 8, 8, 1)).astype(np.uint8),
            "label": rng.integers(0, 10, rows).astype(np.int32),
        }
    return rng.integers(0, cfg.data.vocab_size, (rows, cfg.data.seq_len + 1)).astype(np.int32)


def families(repeats: int) -> None:
    """Every family's learner and DP step, ours alone (see the module docstring)."""
    configure_host()
    print(
        f"# throughput --families  {time.strftime('%Y-%m-%d %H:%M')}  {platform.machine()}  "
        f"{len(os.sched_getaffinity(0))} cores  load average {load_average()}  jax {jax.__version__}"
    )
    peak = jax_matmul_flops()
    print(f"peak: {peak / 1e9:,.1f} GFLOP/s = best float32 {PEAK_N}² matmul here (JAX)")
    rng = np.random.default_rng(0)
    runners, meta = {}, {}
    for name in FAMILY_CONFIGS:
        cfg = load_spec("config", ROOT / "configs" / f"{name}.yaml")
        shape = (
            InputShape(image_shape=(8, 8, 1), num_classes=10, pixel_max=16)
            if cfg.data.modality == "image"
            else InputShape(vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len)
        )
        spec = build_model(cfg.model, shape)
        tx = make_inner_tx(cfg.diloco.inner, 1000)
        for step, bs, g in (
            ("learner", cfg.diloco.batch_size, cfg.learner_microbatches),
            ("DP", cfg.dp_batch_size, cfg.dp_microbatches),
        ):
            key = (name, step)
            runners[key] = ours(spec, tx, family_batch(cfg, bs, rng), g)
            meta[key] = (cfg.model.kind, bs, g, bs * cfg.units_per_row, cfg.unit, spec)
    for run in runners.values():
        run(2)
    times = {k: [] for k in runners}
    for _ in range(repeats):
        for key, run in runners.items():
            run(1)
            t = time.perf_counter()
            run(STEPS)
            times[key].append((time.perf_counter() - t) / STEPS)
    print(f"median of {repeats} turns of {STEPS} steps; load average now {load_average()}")
    print(
        f"{'config':<9}{'kind':<9}{'step':<8}{'rows':>5}{'micro':>6}{'params':>11}{'active':>11}"
        f"{'ms':>8}{'units/s':>11} {'unit':<7}{'MFU':>7}"
    )
    for key, (kind, bs, g, units, unit, spec) in meta.items():
        sec = statistics.median(times[key])
        active = spec.extras.get("active_params", spec.params)
        print(
            f"{key[0]:<9}{kind:<9}{key[1]:<8}{bs:>5}{'-' if g == 1 else str(bs // g):>6}{spec.params:>11,}"
            f"{active:>11,}{sec * 1e3:>8.1f}{units / sec:>11,.0f} {unit:<7}"
            f"{units / sec * spec.flops_per_unit / peak:>7.1%}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    ap.add_argument("--repeats", type=int, default=11, help="timed turns of every step kind (median)")
    ap.add_argument("--families", action="store_true", help="every shipped model family's steps, ours alone")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be ≥ 1, got {args.repeats}")
    if args.families:
        families(args.repeats)
        return
    try:
        cfg = load_spec("config", args.config)
    except ValueError as exc:
        ap.error(str(exc))
    host = configure_host()
    V, L = cfg.data.vocab_size, cfg.data.seq_len
    spec = build_model(cfg.model, InputShape(vocab_size=V, seq_len=L))
    fpt = flops_per_token(cfg.model, V, L)
    ncores = len(os.sched_getaffinity(0))  # JAX sizes its thread pool from the same mask
    if torch is not None:
        torch.set_num_threads(cores())
    print(
        f"# throughput  {time.strftime('%Y-%m-%d %H:%M')}  {platform.machine()}  {ncores} cores  "
        f"load average {load_average()}  jax {jax.__version__}"
        + (f"  torch {torch.__version__} ({torch.get_num_threads()} threads)" if torch else "")
        + f"  malloc keeps freed memory: {host}"
    )
    if torch is None:
        print(
            "PyTorch is not installed (optional: `make bench-torch` installs "
            "benchmarks/requirements-torch.txt); JAX figures only."
        )
    else:
        n_torch = torch_params(TorchTrainer(cfg.model, cfg.diloco.inner, V, L).model)
        assert n_torch == spec.params, f"PyTorch reference has {n_torch:,} parameters, ours {spec.params:,}"
    print(
        f"model: {spec.params:,} params (PyTorch reference: {'same' if torch else 'not run'}), "
        f"{fpt / 1e6:.2f} MFLOPs/token (training), seq_len {L}, vocab {V}"
    )
    peak_jax = jax_matmul_flops()
    peak_torch = torch_matmul_flops() if torch else 0.0
    peak = max(peak_jax, peak_torch)
    print(
        f"peak: {peak / 1e9:,.1f} GFLOP/s = best float32 {PEAK_N}² matmul here "
        f"(JAX {peak_jax / 1e9:,.1f}" + (f", PyTorch {peak_torch / 1e9:,.1f}" if torch else "") + ")"
    )

    rng = np.random.default_rng(0)
    rows = []  # (name, batch rows, microbatches)
    for name, bs, g in (
        ("learner step", cfg.diloco.batch_size, cfg.learner_microbatches),
        ("DP step", cfg.dp_batch_size, cfg.dp_microbatches),
    ):
        rows += [(name, bs, 1)] + ([(name, bs, g)] if g > 1 else [])
    tx = make_inner_tx(cfg.diloco.inner, 1000)  # one optimizer object: one compile per step shape
    runners: dict[tuple, Callable[[int], float]] = {}
    for name, bs, g in rows:
        batch = rng.integers(0, V, (bs, L + 1)).astype(np.int32)
        runners[(name, bs, g, "jax")] = ours(spec, tx, batch, g)
        if torch:
            runners[(name, bs, g, "torch")] = theirs(cfg, batch, g, V)
    for run in runners.values():  # compile, warm caches and allocators
        run(2)
    times: dict[tuple, list[float]] = {k: [] for k in runners}
    for _ in range(args.repeats):
        for key, run in runners.items():
            run(1)
            t = time.perf_counter()
            run(STEPS)
            times[key].append((time.perf_counter() - t) / STEPS)

    print(
        f"ms per step: median of {args.repeats} turns of {STEPS} steps; "
        f"ratio = PyTorch time / ours (> 1: ours faster); load average now {load_average()}"
    )
    print(
        f"{'step':<14}{'rows':>5}{'micro':>6}  {'ours ms':>8}{'torch ms':>9}{'ratio':>7}  "
        f"{'ours tok/s':>10}{'MFU':>7}  {'torch tok/s':>11}{'MFU':>7}"
    )
    for name, bs, g in rows:
        tokens = bs * L
        ours_s = statistics.median(times[(name, bs, g, "jax")])
        cells = [f"{name:<14}{bs:>5}{'-' if g == 1 else str(bs // g):>6}  {ours_s * 1e3:>8.1f}"]
        if torch:
            torch_s = statistics.median(times[(name, bs, g, "torch")])
            cells.append(f"{torch_s * 1e3:>9.1f}{torch_s / ours_s:>7.2f}")
        else:
            cells.append(f"{'-':>9}{'-':>7}")
        cells.append(f"  {tokens / ours_s:>10,.0f}{tokens / ours_s * fpt / peak:>7.1%}")
        if torch:
            cells.append(f"  {tokens / torch_s:>11,.0f}{tokens / torch_s * fpt / peak:>7.1%}")
        print("".join(cells))


if __name__ == "__main__":
    main()
