"""Lock-step DiLoCo: where the gap to data-parallel training comes from.

    python benchmarks/lockstep.py [--config configs/default.yaml] [--data RUN_DIR] [-H 8]
                                  [--merge mean|rda] [--outer-lr 1.0] [--outer-momentum 0.0]
                                  [--wire float32|bfloat16|int8|int4[:block]] [--set key=value ...]

The same M learners as the asynchronous run (model, init, shards, batch, inner AdamW and its
schedule, token budget), but stepped in turn in one thread and merged exactly every H inner steps
with all parameters as one fragment: no threads, no in-flight fragments, no staleness, so the
result is deterministic. Comparing it with the asynchronous run and with DP separates three costs:

* H = 1: averaging M AdamW updates taken on small batches is not one AdamW step on their union;
* H > 1: the learners drift apart between merges;
* asynchronous minus lock-step at the same H: progress overwritten while a fragment is in flight,
  staleness, and quorum/grace effects.

Merge: Θ ← Θ − lr·(Δ + μ·buf) with Δ the plain mean (or RDA) of the outer gradients Θ − θ_m
(``diloco.merge``, ``diloco.outer``: the same functions the syncer uses). ``--wire`` sends each
learner's update Δ_m = θ_m − Θ through a wire format first (``diloco.wire``: encoded, decoded, added
back to Θ), so the cost of quantising the submissions is measured without thread timing. Prints the held-out loss
(nats, the same validation batches as the pipeline) at about every eighth of the budget; asserts
nothing. ``--data`` reuses a run directory whose ``data/`` was prepared for the same data config;
without it the data is prepared into a temporary folder first (about 15 s).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax.numpy as jnp

from configs.load import parse_overrides
from configs.specs import load_spec
from data.cursor import batch_at
from data.prepare import prepare_data
from data.store import load_sequences
from diloco.merge import merge_mean, merge_rda
from diloco.outer import make_outer_tx, outer_step
from diloco.tensors import embedding_names, to_numpy
from diloco.wire import WireFormat
from training.decoupled.plan import DiLoCoPlan
from training.decoupled.setup import learner_trainer
from training.evaluation import heldout_loss, val_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--data", type=Path, help="run directory whose data/ is already prepared")
    ap.add_argument("-H", type=int, default=None, help="inner steps between merges (default: diloco.sync_every)")
    ap.add_argument("--merge", choices=["mean", "rda"], default="mean")
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--outer-momentum", type=float, default=0.0)
    ap.add_argument("--wire", default="float32", help="learners' wire format (diloco.wire spec: int4, int8:64, …)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = ap.parse_args()
    try:
        cfg = load_spec("config", args.config, parse_overrides(args.set))
    except ValueError as exc:
        ap.error(str(exc))
    if args.H is not None and args.H < 1:
        ap.error(f"-H must be ≥ 1 inner step, got {args.H}")
    if args.data is not None and not (args.data / "data" / "manifest.json").is_file():
        ap.error(
            f"--data {args.data}: no data/manifest.json there; pass a run directory whose data step "
            "finished, or omit --data to prepare the data first"
        )
    try:
        wire = WireFormat.parse(args.wire)
    except ValueError as exc:
        ap.error(str(exc))
    H = args.H or cfg.diloco.sync_every
    M, B = cfg.diloco.learners, cfg.diloco.batch_size

    run_dir = args.data
    if run_dir is None:
        run_dir = Path(tempfile.mkdtemp(prefix="lockstep-"))
        prepare_data(cfg, run_dir)
    # The learners' own compiled step: model spec of this data, inner optimizer and its schedule,
    # microbatches (training.decoupled.setup); one Trainer shared by the M learners, as in the pipeline.
    trainer = learner_trainer(DiLoCoPlan.of(cfg), run_dir)
    theta = to_numpy(trainer.init_params())
    params = [trainer.init_params() for _ in range(M)]  # every learner starts at Θ₀
    opt_states = [trainer.init_opt(p) for p in params]
    shards = [load_sequences(run_dir, f"shard_{m:02d}") for m in range(M)]
    cursors = [(0, 0)] * M
    outer_tx = make_outer_tx(args.outer_lr, args.outer_momentum, cfg.diloco.outer_nesterov)
    outer_state = outer_tx.init(theta)
    embeddings = embedding_names(theta)
    val = val_batches(load_sequences(run_dir, "val"), cfg.train.eval_batches, cfg.train.eval_batch_size)

    steps = cfg.learner_steps
    tokens_per_round = M * cfg.tokens_per_learner_step
    report_every = max(1, steps // 8)
    print(
        f"lock-step DiLoCo: M={M} batch={B} H={H} merge={args.merge} outer lr={args.outer_lr} "
        f"μ={args.outer_momentum} inner lr={cfg.diloco.inner.lr} steps/learner={steps} wire={wire.spec}",
        flush=True,
    )
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        for m in range(M):
            batch, *cursors[m] = batch_at(shards[m], *cursors[m], batch_size=B, seed=cfg.seed + 1000 * (m + 1))
            # the step donates its parameter and optimizer buffers: keep only what it returns
            params[m], opt_states[m], _ = trainer.step(params[m], opt_states[m], jnp.asarray(batch))
        if step % H == 0 or step == steps:
            copies = [to_numpy(p) for p in params]
            if wire.sends_delta:  # what the syncer rebuilds: Θ + decode(encode(θ_m − Θ))
                shapes = {k: v.shape for k, v in theta.items()}
                copies = [
                    {k: theta[k] + d[k] for k in theta}
                    for d in (wire.decode(wire.encode({k: c[k] - theta[k] for k in theta}), shapes) for c in copies)
                ]
            outer_grads = [{k: theta[k] - v for k, v in c.items()} for c in copies]
            rule = merge_rda if args.merge == "rda" else merge_mean
            delta = rule(outer_grads, [1] * M, [1] * M, embeddings)
            theta, outer_state = outer_step(outer_tx, theta, outer_state, delta)
            params = [{k: jnp.asarray(v) for k, v in theta.items()} for _ in range(M)]
        if step % report_every == 0 or step == steps:
            loss = heldout_loss(trainer.evaluate, {k: jnp.asarray(v) for k, v in theta.items()}, val)
            print(
                f"  tokens {step * tokens_per_round:>10,}  held-out loss {loss:.4f} nats  "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
