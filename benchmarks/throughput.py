"""Training throughput and model FLOP utilisation (MFU) for one learner step and one DP step.

    python benchmarks/throughput.py [--config configs/default.yaml] [--steps 20] [--peak-gflops X]
                                    [--set key=value ...]

MFU = achieved model FLOP/s ÷ peak FLOP/s, with model FLOPs per token from
``models.flops_per_token`` (6·N_matmul + 12·n_layers·d_model·L, the PaLM accounting). On a CPU there
is no datasheet peak, so by default the peak is *measured*: the best FLOP/s of a large float32
matmul (4096², jitted) on this machine. Pass ``--peak-gflops`` for a datasheet figure instead
(e.g. 989e3 for one H100 in bf16 dense). Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.schema import load_config_checked, parse_overrides
from models import build_model, count_params, flops_per_token
from models.training import make_inner_tx, train_step


def measured_peak_gflops(n: int = 4096, reps: int = 5) -> float:
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def bench_step(cfg, batch_size: int, steps: int, vocab: int, microbatches: int = 1) -> tuple[float, float]:
    model = build_model(cfg.model, vocab, cfg.data.seq_len, nnx.Rngs(0))
    opt = nnx.Optimizer(model, make_inner_tx(cfg.diloco.inner, 1000), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, vocab, (batch_size, cfg.data.seq_len + 1)), dtype=jnp.int32)
    float(train_step(model, opt, batch, microbatches))  # compile
    t = time.perf_counter()
    for _ in range(steps):
        loss = train_step(model, opt, batch, microbatches)
    float(loss)
    dt = (time.perf_counter() - t) / steps
    return dt, batch_size * cfg.data.seq_len / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "default.yaml"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--peak-gflops", type=float, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = ap.parse_args()
    try:
        cfg = load_config_checked(args.config, parse_overrides(args.set))
    except ValueError as exc:
        ap.error(str(exc))
    if args.steps < 1:
        ap.error(f"--steps must be ≥ 1 timed step, got {args.steps}")
    if args.peak_gflops is not None and not args.peak_gflops > 0:
        ap.error(f"--peak-gflops must be > 0 GFLOP/s, got {args.peak_gflops}")
    vocab = cfg.data.vocab_size
    peak = args.peak_gflops or measured_peak_gflops()
    fpt = flops_per_token(cfg.model, vocab, cfg.data.seq_len)
    params = count_params(build_model(cfg.model, vocab, cfg.data.seq_len, nnx.Rngs(0)))
    print(f"# throughput  {time.strftime('%Y-%m-%d')}  {platform.machine()}  {os.cpu_count()} cores  "
          f"jax {jax.__version__}  devices {jax.devices()}")
    print(f"model: {params:,} params, {fpt / 1e6:.2f} MFLOPs/token (training), seq_len {cfg.data.seq_len}")
    print(f"peak: {peak:,.1f} GFLOP/s ({'given' if args.peak_gflops else 'measured 4096² f32 matmul'})")
    print(f"{'step':<22}{'batch (seqs)':>14}{'micro':>7}{'ms/step':>10}{'tokens/s':>12}{'GFLOP/s':>10}{'MFU':>8}")
    rows = [("learner inner step", cfg.diloco.batch_size, 1), ("DP step", cfg.dp_batch_size, 1)]
    if cfg.train.microbatch_size:  # the configured split (what the pipeline runs), after the whole batch
        rows = [rows[0], ("learner inner step", cfg.diloco.batch_size, cfg.learner_microbatches),
                rows[1], ("DP step", cfg.dp_batch_size, cfg.dp_microbatches)]
    for name, bs, k in rows:
        dt, tps = bench_step(cfg, bs, args.steps, vocab, k)
        gflops = tps * fpt / 1e9
        micro = "-" if k == 1 else str(bs // k)
        print(f"{name:<22}{bs:>14}{micro:>7}{dt * 1e3:>10.1f}{tps:>12,.0f}{gflops:>10.1f}{gflops / peak:>8.1%}")


if __name__ == "__main__":
    main()
