"""Golden losses: per-step losses of two tiny deterministic runs on the committed small corpus.

    python -m tests.golden.record            # print the runs' losses beside the recorded ones
    python -m tests.golden.record --write    # refresh tests/golden/*.json (a deliberate change)

* ``dp.json``: the data-parallel loop, every step's training loss and the held-out loss before
  and after training.
* ``lockstep.json``: lock-step Decoupled DiLoCo: M learners stepped in turn in one thread, each
  fragment sent on its staggered schedule, the syncer merging a fragment as soon as all M copies
  are in (quorum M, no grace window), every learner receiving it before its next step. No threads,
  so the result is deterministic; it exercises the inner step, fragments, the token-weighted merge,
  the outer step and the receipt rule.

``tests/test_golden.py`` reruns both and compares (tolerance there). Refresh only when a change is
meant to move the losses, and say why in the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "data" / "shakespeare_small.jsonl"
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def golden_config():
    """The tiny config on the committed corpus, DiLoCo without momentum (M=3, P=3, H=4); no play held
    out for fine-tuning (the pretraining data the losses were recorded on)."""
    from configs.load import load_config

    return load_config(
        ROOT / "configs" / "tiny.yaml",
        {
            "data.source": "local",
            "data.paths": [str(CORPUS)],
            "train.token_budget": 12288,
            "data.finetune_docs": 0,
            "finetune.enabled": False,
        },
    )


def run_dp(cfg, run_dir: Path) -> dict:
    """The DP loop itself (``training.dp.train_dp``), every step's loss read through its hook."""
    from run.layout import RunLayout
    from run.metrics import read_jsonl
    from training.dp import train_dp

    losses: list[float] = []
    train_dp(cfg, run_dir, on_step=lambda step, metrics: losses.append(float(metrics["loss"])))
    evals = [r["val/loss"] for r in read_jsonl(RunLayout(run_dir).metrics("pretrain", "dp", "eval"))]
    return {"train_loss": losses, "heldout_loss": [evals[0], evals[-1]]}


def run_lockstep(cfg, run_dir: Path) -> dict:
    """Lock-step DiLoCo with the pieces of the asynchronous run: the learners' compiled step, the
    fragment schedule, the syncer (quorum M, no grace) and the configured receipt rule."""
    import jax.numpy as jnp

    from data.cursor import batch_at
    from data.store import load_sequences
    from diloco.exchange import Submission
    from diloco.fragments import balanced_fragments, fragments_due
    from diloco.learner import FragmentState
    from diloco.receipt import receipt_rule
    from diloco.syncer import Syncer, SyncerSettings
    from diloco.tensors import embedding_names, tensor_bytes, to_numpy
    from training.decoupled.plan import DiLoCoPlan
    from training.decoupled.setup import learner_trainer
    from training.evaluation import heldout_loss, val_batches

    d = cfg.diloco
    M = d.learners
    trainer = learner_trainer(DiLoCoPlan.of(cfg), run_dir)
    theta0 = to_numpy(trainer.init_params())
    fragments = balanced_fragments(tensor_bytes(theta0), d.fragments)
    syncer = Syncer(
        theta0,
        fragments,
        SyncerSettings(
            num_learners=M,
            quorum=M,
            grace_s=0.0,
            merge=d.merge,
            outer_lr=d.outer_lr,
            outer_momentum=d.outer_momentum,
            outer_nesterov=d.outer_nesterov,
            max_staleness=0,
        ),
        embedding_names(theta0),
    )
    rule = receipt_rule(d.receipt, d.mix_alpha)
    params = [trainer.init_params() for _ in range(M)]
    opt = [trainer.init_opt(p) for p in params]
    frags = [
        [FragmentState(list(names), version=0, reference=syncer.global_params[p]) for p, names in enumerate(fragments)]
        for _ in range(M)
    ]
    shards = [load_sequences(run_dir, f"shard_{m:02d}") for m in range(M)]
    cursors = [(0, 0)] * M
    val = val_batches(load_sequences(run_dir, "val"), cfg.train.eval_batches, cfg.train.eval_batch_size)
    losses, merges = [], []
    tps = cfg.tokens_per_learner_step
    for step in range(1, cfg.learner_steps + 1):
        row = []
        for m in range(M):
            batch, *cursors[m] = batch_at(
                shards[m], *cursors[m], batch_size=d.batch_size, seed=cfg.seed + 1000 * (m + 1)
            )
            params[m], opt[m], metrics = trainer.step(params[m], opt[m], jnp.asarray(batch))
            row.append(float(metrics["loss"]))
            for f in frags[m]:
                f.stepped(tps)
        losses.append(row)
        due = fragments_due(step, len(fragments), d.sync_every)
        if step == cfg.learner_steps:
            due = list(range(len(fragments)))
        for p in due:
            for m in range(M):
                f = frags[m][p]
                copy = to_numpy({k: params[m][k] for k in f.names})
                syncer.receive(
                    Submission(
                        learner=m,
                        fragment=p,
                        params=copy,
                        tokens=f.tokens,
                        steps=f.steps,
                        base_version=f.version,
                        local_step=step,
                    ),
                    0.0,
                )
                f.sent(copy)
            records = syncer.poll(0.0, set(range(M)))
            assert [r["fragment"] for r in records] == [p], records
            merges.append({"step": step, "fragment": p, "outer_grad_norm": records[0]["outer_grad_norm"]})
            theta = syncer.global_params[p]
            for m in range(M):
                f = frags[m][p]
                new = rule.apply(theta, to_numpy({k: params[m][k] for k in f.names}), f.reference)
                params[m] = {**params[m], **{k: jnp.asarray(v) for k, v in new.items()}}
                f.received(syncer.versions[p], theta, rule.keeps_progress)
    final = {k: jnp.asarray(v) for k, v in syncer.params().items()}
    return {"train_loss": losses, "merges": merges, "heldout_loss": [heldout_loss(trainer.evaluate, final, val)]}


def run_all() -> dict[str, dict]:
    from data.prepare import prepare_data

    cfg = golden_config()
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        prepare_data(cfg, tmp)
        return {"dp": run_dp(cfg, Path(tmp)), "lockstep": run_lockstep(cfg, Path(tmp))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="overwrite tests/golden/*.json with this run's losses")
    args = ap.parse_args()
    runs = run_all()
    for name, got in runs.items():
        path = HERE / f"{name}.json"
        if args.write:
            path.write_text(json.dumps(got, indent=1) + "\n")
            print(f"wrote {path}")
        elif path.exists():
            want = json.loads(path.read_text())
            import numpy as np

            dev = {
                k: float(np.max(np.abs(np.asarray(got[k]) - np.asarray(want[k]))))
                for k in ("train_loss", "heldout_loss")
                if np.shape(got[k]) == np.shape(want[k])
            }
            print(
                f"{name}: held-out loss {got['heldout_loss']} (recorded {want['heldout_loss']}); largest "
                f"deviation per step: train {dev.get('train_loss', 'shape differs')}, held-out "
                f"{dev.get('heldout_loss', 'shape differs')} nats"
            )
        else:
            print(f"{name}: held-out loss {got['heldout_loss']} (nothing recorded yet)")


if __name__ == "__main__":
    main()
