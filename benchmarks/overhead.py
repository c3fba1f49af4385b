"""What share of the raw learner step speed a whole Decoupled DiLoCo run keeps; with ``--versus-dp``,
whole DiLoCo and DP runs side by side, each with tracking on and off.

    python benchmarks/overhead.py [--config configs/default.yaml] [--tokens 600000] [--data RUN_DIR]
                                  [--set key=value ...]
    python benchmarks/overhead.py --versus-dp [--rounds 2] [...]
    python benchmarks/overhead.py --breakdown [...]

``--versus-dp``: whole runs of both methods on the same data, token budget and cores (DiLoCo as
above; DP: ``training.dp.train_dp``, its evaluations and checkpoints included), each with the config's
``tracking`` (TensorBoard event files fed from the metric writers) and with every tracker off; the
four arms take turns within each of ``--rounds`` rounds (a load that comes and goes falls on all of
them), after one untimed short run of each method (compilation). Figures: tokens/s per arm (median
over rounds), DiLoCo ÷ DP with and without tracking, and tracking's cost per method (1 − on ÷ off).

``--breakdown``: the run's wall time split by its compute turns (``diloco.pacing.FairTurns``'s
``observer``; :func:`print_breakdown`) and its CPU seconds by thread (Linux ``/proc``).

Raw speed: the learners' compiled step alone, back to back on the same batches (tokens/s, median of
repeated timings). Run speed: a real run of the same config (``training.decoupled``: M learner threads
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

from configs.load import parse_overrides  # noqa: E402
from configs.specs import load_spec  # noqa: E402
from data.cursor import batch_at  # noqa: E402
from data.prepare import prepare_data  # noqa: E402
from data.store import load_sequences  # noqa: E402
from diloco.pacing import FairTurns  # noqa: E402
from run.layout import RunLayout  # noqa: E402
from run.metrics import read_jsonl  # noqa: E402
from training.decoupled.plan import DiLoCoPlan  # noqa: E402
from training.decoupled.setup import learner_attempt, learner_trainer, learner_turns, setup_diloco  # noqa: E402
from training.decoupled.syncer import run_syncer_to_end  # noqa: E402
from training.evaluation import heldout_loss, val_batches  # noqa: E402


def raw_tokens_per_s(cfg, run_dir: Path, repeats: int) -> tuple[float, float]:
    """(tokens/s, ms/step) of the learner step alone, after warm-up; also compiles the eval step."""
    trainer = learner_trainer(DiLoCoPlan.of(cfg), run_dir)
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


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far per thread of this process, by thread id: ``{tid: (name, seconds)}``
    (Linux ``/proc/self/task``; {} elsewhere). XLA:CPU's compute threads are named ``tf_XLAEigen``,
    every Python thread ``python``."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for task in Path("/proc/self/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[task.name] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
        except (OSError, IndexError, ValueError):
            continue
    return out


def run_tokens_per_s(cfg, run_dir: Path, breakdown: bool = False) -> dict:
    run = setup_diloco(cfg, run_dir)
    out: dict = {}
    turns_log: list[tuple[float, float, float]] = []
    if breakdown:
        turns = learner_turns(DiLoCoPlan.of(cfg), run_dir)
        if not isinstance(turns, FairTurns):
            raise SystemExit("--breakdown needs the thread engine's turns (diloco.compute_slots ≥ 1)")
        turns.observer = lambda asked, got, released: turns_log.append((asked, got, released))
        cpu0 = thread_cpu()
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
    t_end = time.perf_counter()
    wall = t_end - t0
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
        **({"turns": sorted(turns_log, key=lambda t: t[1]), "t0": t0, "t_end": t_end} if breakdown else {}),
        **({"cpu": cpu_since(cpu0)} if breakdown else {}),
    }


def cpu_since(before: dict) -> dict[str, float]:
    """CPU seconds per thread name since ``before`` (:func:`thread_cpu`)."""
    by_name: dict[str, float] = {}
    for tid, (name, sec) in thread_cpu().items():
        by_name[name] = by_name.get(name, 0.0) + sec - before.get(tid, (name, 0.0))[1]
    return by_name


def print_breakdown(got: dict, raw_ms: float) -> None:
    """Where a run's wall time went, from its turns (``FairTurns.observer``): with one compute slot the
    learners' steps run one at a time, so the wall time is the turns held, the idle hand-overs
    between them, and the time before the first turn and after the last. Each turn is split into
    the raw step (``raw_ms``), the first turn's extra (compiling the step in this run), the median
    turn's extra over the raw step (blocking on every step for the turns, the Python threads'
    work and the other learners' state on the same cores), and the tail (turns longer than the
    median: those overlapping the syncer's evaluations of Θ, resume points, merges)."""
    turns, wall = got["turns"], got["wall_s"]
    held = [r - g for _, g, r in turns]
    n, raw = len(held), raw_ms / 1e3
    med = statistics.median(held[1:])
    gaps = sum(max(turns[k + 1][1] - turns[k][2], 0.0) for k in range(n - 1))
    outside = (turns[0][1] - got["t0"]) + (got["t_end"] - turns[-1][2])
    parts = [
        (f"raw step × {n:,} steps", n * raw),
        ("first turn's extra over the raw step (compiling it, unless compiled before)", held[0] - raw),
        (f"median turn's extra over the raw step ({1e3 * med:.1f} ms vs {raw_ms:.1f})", (n - 1) * (med - raw)),
        ("turns beyond the median (beside evaluations of Θ, resume points, merges)", sum(held[1:]) - (n - 1) * med),
        ("hand-overs between learners", gaps),
        ("before the first turn and after the last (set-up; final evaluation, checkpoint)", outside),
    ]
    print(
        f"where the wall time went ({wall:.1f} s; turns held {sum(held):.1f} s; the evaluations of Θ during "
        "training lengthen the turns beside them, the final one falls after the last turn):"
    )
    for label, sec in parts:
        print(f"  {label:<82} {sec:7.2f} s {sec / wall:6.1%}")
    print(f"  {'(sum)':<82} {sum(s for _, s in parts):7.2f} s")
    pct = statistics.quantiles(held[1:], n=100)
    print(
        "  turn ms, percentiles 50/90/99: "
        f"{1e3 * med:.1f} / {1e3 * pct[89]:.1f} / {1e3 * pct[98]:.1f}; first {1e3 * held[0]:.0f}, "
        f"longest after it {1e3 * max(held[1:]):.0f}"
    )
    cpu = got["cpu"]
    xla = sum(v for k, v in cpu.items() if k.startswith("tf_"))
    py = cpu.get("python", 0.0)
    other = sum(cpu.values()) - xla - py
    cores = os.cpu_count() or 1
    print(
        f"CPU seconds over the run: XLA compute threads {xla:.1f}, Python threads {py:.1f}, other {other:.1f}; "
        f"{sum(cpu.values()) / (wall * cores):.0%} of {cores} cores × {wall:.1f} s"
    )


def dp_tokens_per_s(cfg, run_dir: Path) -> dict:
    from training.dp import train_dp

    t0 = time.perf_counter()
    summary = train_dp(cfg, run_dir)
    wall = time.perf_counter() - t0
    return {"tokens": summary["tokens"], "wall_s": wall, "tokens_per_s": summary["tokens"] / wall}


def versus_dp(config: str, overrides: dict, data_dir: Path, base: Path, rounds: int) -> None:
    """Whole DiLoCo and DP runs, tracking on and off, in turns (see the module docstring)."""
    cfg = load_spec("config", config, overrides)
    untracked = load_spec("config", config, {**overrides, "tracking.tensorboard": False, "tracking.wandb": False})
    short = load_spec("config", config, {**overrides, "train.token_budget": cfg.train.token_budget // 8})
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
    ap.add_argument(
        "--breakdown", action="store_true", help="where the run's wall time went: its turns, hand-overs, CPU by thread"
    )
    args = ap.parse_args()
    overrides = {"train.token_budget": args.tokens, **parse_overrides(args.set)}
    try:
        cfg = load_spec("config", args.config, overrides)
    except ValueError as exc:
        ap.error(str(exc))
    if args.breakdown and (args.versus_dp or cfg.runtime.engine != "threads" or not cfg.diloco.compute_slots):
        ap.error(
            "--breakdown times the thread engine's compute turns: use it without --versus-dp, with "
            "runtime.engine threads and diloco.compute_slots ≥ 1"
        )
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
    got = run_tokens_per_s(cfg, run_dir, breakdown=args.breakdown)
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
    if args.breakdown:
        print_breakdown(got, ms)


if __name__ == "__main__":
    main()
