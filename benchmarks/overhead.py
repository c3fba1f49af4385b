"""What share of the raw learner step speed a whole Decoupled DiLoCo run keeps; with ``--versus-dp``,
whole DiLoCo and DP runs side by side, each with tracking on and off.

    python benchmarks/overhead.py [--config configs/default.yaml] [--tokens 600000] [--data RUN_DIR]
                                  [--set key=value ...]
    python benchmarks/overhead.py --versus-dp [--rounds 2] [...]

``--versus-dp``: whole runs of both methods on the same data, token budget and cores (DiLoCo as
above; DP: ``training.dp.train_dp``, its evaluations and checkpoints included), each with the config's
``tracking`` (TensorBoard event files fed from the metric writers) and with every tracker off; the
four arms take turns within each of ``--rounds`` rounds (a load that comes and goes falls on all of
them), after one untimed short run of each method (compilation). Figures: tokens/s per arm (median
over rounds), DiLoCo ÷ DP with and without tracking, and tracking's cost per method (1 − on ÷ off).

Raw speed: the learners' compiled step alone, back to back on the same batches (tokens/s, median of
repeated timings). Run speed: a real run of the same config (``training.diloco``: M learner threads
in first-come turns, the syncer thread merging, publishing and evaluating Θ on the cadence, resume
points saved) over ``--tokens`` tokens, wall time from the learners' start to the syncer's end,
compiled code warmed up first. With ``diloco.compute_slots: 1`` the learners take turns on the CPU,
so the run's ideal is the raw single-stream speed: share = run tokens/s ÷ raw tokens/s, and
1 − share is the overhead (merges, evaluation, resume points, Python between steps); the share is
also given without the time the evaluations of Θ took (``eval_s`` in the eval log). Prints figures;
asserts nothing. Without ``--data`` the data is prepared into a temporary folder first (~15 s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from configs.load import load_config_checked, parse_overrides  # noqa: E402
from data.cursor import batch_at  # noqa: E402
from data.store import load_sequences  # noqa: E402
from data.text import prepare_data  # noqa: E402
from run.layout import RunLayout  # noqa: E402
from run.metrics import read_jsonl  # noqa: E402
from training.diloco import learner_attempt, learner_trainer, run_syncer_to_end, setup_diloco  # noqa: E402
from training.evaluation import heldout_loss, val_batches  # noqa: E402


def raw_tokens_per_s(cfg, run_dir: Path, repeats: int) -> tuple[float, float]:
    """(tokens/s, ms/step) of the learner step alone, after warm-up; also compiles the eval step."""
    trainer = learner_trainer(cfg, run_dir)
    seqs = load_sequences(run_dir, "shard_00")
    batches = [jnp.asarray(batch_at(seqs, 0, 0, cfg.diloco.batch_size, cfg.seed + i)[0]) for i in range(4)]
    params = trainer.init_params()
    opt = trainer.init_opt(params)
    for b in batches[:2]:
        params, opt, m = trainer.step(params, opt, b)
    jax.block_until_ready(m["loss"])
    val = val_batches(load_sequences(run_dir, "val"), cfg.train.eval_batches, cfg.train.eval_batch_size)
    heldout_loss(trainer.evaluate, params, val)  # compile the syncer's evaluation too
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for b in batches:
            params, opt, m = trainer.step(params, opt, b)
        jax.block_until_ready(m["loss"])
        times.append((time.perf_counter() - t) / len(batches))
    ms = statistics.median(times) * 1e3
    return cfg.tokens_per_learner_step / (ms / 1e3), ms


def run_tokens_per_s(cfg, run_dir: Path) -> dict:
    run = setup_diloco(cfg, run_dir)
    out: dict = {}
    t0 = time.perf_counter()
    learners = [
        threading.Thread(target=lambda m=m: out.setdefault(m, learner_attempt(cfg, run_dir, m, 1)))
        for m in range(cfg.diloco.learners)
    ]
    syncer = threading.Thread(target=lambda: out.setdefault("syncer", run_syncer_to_end(run)))
    for t in learners:
        t.start()
    syncer.start()
    for t in learners:
        t.join()
    run.exchange.mark_learners_done()
    syncer.join()
    wall = time.perf_counter() - t0
    run.close_logs()
    summary = out["syncer"]
    layout = RunLayout(run_dir)
    evals = read_jsonl(layout.metrics("pretrain", "diloco", "eval"))
    return {
        "tokens": summary["tokens"],
        "wall_s": wall,
        "tokens_per_s": summary["tokens"] / wall,
        "merges": summary["merges"],
        "evals": len(evals),
        "eval_s": sum(e.get("eval_s", 0.0) for e in evals),
        "val_loss": summary["final_val_loss"],
    }


def dp_tokens_per_s(cfg, run_dir: Path) -> dict:
    from training.dp import train_dp

    t0 = time.perf_counter()
    summary = train_dp(cfg, run_dir)
    wall = time.perf_counter() - t0
    return {"tokens": summary["tokens"], "wall_s": wall, "tokens_per_s": summary["tokens"] / wall}


def versus_dp(config: str, overrides: dict, data_dir: Path, base: Path, rounds: int) -> None:
    """Whole DiLoCo and DP runs, tracking on and off, in turns (see the module docstring)."""
    cfg = load_config_checked(config, overrides)
    untracked = load_config_checked(config, {**overrides, "tracking.tensorboard": False, "tracking.wandb": False})
    short = load_config_checked(config, {**overrides, "train.token_budget": cfg.train.token_budget // 8})
    arms = {
        "diloco": (cfg, run_tokens_per_s),
        "dp": (cfg, dp_tokens_per_s),
        "diloco, no tracking": (untracked, run_tokens_per_s),
        "dp, no tracking": (untracked, dp_tokens_per_s),
    }
    n = 0

    def fresh_dir() -> Path:
        nonlocal n
        n += 1
        rd = base / f"run-{n}"
        rd.mkdir()
        os.symlink((Path(data_dir) / "data").absolute(), rd / "data")
        return rd

    run_tokens_per_s(short, fresh_dir())  # compile both methods' steps first
    dp_tokens_per_s(short, fresh_dir())
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        for name, (c, fn) in arms.items():
            got = fn(c, fresh_dir())
            rates[name].append(got["tokens_per_s"])
            print(
                f"  round {r + 1} {name:<20} {got['tokens']:,} tokens in {got['wall_s']:.1f} s "
                f"= {got['tokens_per_s']:,.0f} tokens/s"
            )
    med = {name: statistics.median(v) for name, v in rates.items()}
    print(f"tokens/s, median of {rounds} rounds: " + ", ".join(f"{k} {v:,.0f}" for k, v in med.items()))
    print(
        f"DiLoCo / DP: {med['diloco'] / med['dp']:.1%} with tracking, "
        f"{med['diloco, no tracking'] / med['dp, no tracking']:.1%} without"
    )
    print(
        f"tracking's cost (1 - on / off): DiLoCo {1 - med['diloco'] / med['diloco, no tracking']:+.1%}, "
        f"DP {1 - med['dp'] / med['dp, no tracking']:+.1%}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--tokens", type=int, default=600_000, help="token budget of the measured run")
    ap.add_argument("--data", type=Path, help="run directory whose data/ is prepared for this data config")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--versus-dp", action="store_true", help="whole DiLoCo and DP runs, tracking on and off")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the --versus-dp arms")
    args = ap.parse_args()
    overrides = {"train.token_budget": args.tokens, **parse_overrides(args.set)}
    try:
        cfg = load_config_checked(args.config, overrides)
    except ValueError as exc:
        ap.error(str(exc))
    base = Path(tempfile.mkdtemp(prefix="overhead-"))
    data_dir = args.data or base / "data-run"
    if args.data is None:
        prepare_data(cfg, data_dir)
    if args.versus_dp:
        d = cfg.diloco
        print(
            f"config {args.config}: M={d.learners} P={d.fragments} H={d.sync_every} K={d.quorum}, "
            f"{cfg.train.token_budget:,} tokens, DP batch {cfg.dp.batch_size}, "
            f"tracking: TensorBoard {'on' if cfg.tracking.tensorboard else 'off'}"
        )
        versus_dp(args.config, overrides, Path(data_dir), base, args.rounds)
        return
    run_dir = base / "run"
    run_dir.mkdir()
    os.symlink((Path(data_dir) / "data").absolute(), run_dir / "data")
    raw, ms = raw_tokens_per_s(cfg, run_dir, args.repeats)
    got = run_tokens_per_s(cfg, run_dir)
    raw_after, _ = raw_tokens_per_s(cfg, run_dir, args.repeats)  # the machine may have changed meanwhile
    raw_mean = (raw + raw_after) / 2
    d = cfg.diloco
    print(
        f"config {args.config}: M={d.learners} P={d.fragments} H={d.sync_every} K={d.quorum}, "
        f"{cfg.tokens_per_learner_step} tokens per learner step, resume point every "
        f"{d.resume_every_steps or 'never'} steps, evaluation every {cfg.train.eval_every_tokens:,} tokens"
    )
    print(f"raw learner step: {ms:.1f} ms ({raw:,.0f} tokens/s before the run, {raw_after:,.0f} after)")
    print(
        f"whole run: {got['tokens']:,} tokens in {got['wall_s']:.1f} s = {got['tokens_per_s']:,.0f} tokens/s "
        f"({got['merges']} merges, {got['evals']} evaluations, held-out loss {got['val_loss']:.3f})"
    )
    print(
        f"share of raw step speed kept: {got['tokens_per_s'] / raw_mean:.1%} "
        f"(overhead {1 - got['tokens_per_s'] / raw_mean:.1%})"
    )
    # Θ's evaluations run on the same cores as the steps (on separate hardware in a real deployment)
    # and measure the run rather than train it; DP pays the same per evaluation.
    train_s = got["wall_s"] - got["eval_s"]
    print(
        f"  evaluations of Θ: {got['evals']} taking {got['eval_s']:.1f} s ({got['eval_s'] / got['wall_s']:.1%} "
        f"of the wall time); without them: {got['tokens'] / train_s / raw_mean:.1%} kept "
        f"(overhead {1 - got['tokens'] / train_s / raw_mean:.1%}: merges, resume points, Python between steps)"
    )


if __name__ == "__main__":
    main()
