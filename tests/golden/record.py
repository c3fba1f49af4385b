"""Golden losses: per-step losses of two tiny deterministic runs on the committed small corpus.

    python -m tests.golden.record            # print the runs' losses beside the recorded ones
    python -m tests.golden.record --write    # refresh tests/golden/*.json (a deliberate change)

* ``dp.json``: the data-parallel loop, every step's training loss and the held-out loss at each
  evaluation.
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
    """The tiny config on the committed corpus, DiLoCo without momentum (M=3, P=3, H=4)."""
    from configs.schema import load_config

    return load_config(ROOT / "configs" / "tiny.yaml", {
        "data.source": "local", "data.paths": [str(CORPUS)], "train.token_budget": 12288,
    })


def run_dp(cfg, run_dir: Path) -> dict:
    import jax.numpy as jnp
    from flax import nnx

    from models.training import heldout_loss, make_inner_tx, train_step, val_batches
    from tasks.data import batch_at, load_manifest, load_sequences
    from tasks.pretrain import _model_factory

    model = _model_factory(cfg, int(load_manifest(run_dir)["vocab_size"]))()
    optimizer = nnx.Optimizer(model, make_inner_tx(cfg.dp.inner, cfg.dp_steps), wrt=nnx.Param)
    seqs = load_sequences(run_dir, "train")
    val = val_batches(load_sequences(run_dir, "val"), cfg.train.eval_batches, cfg.train.eval_batch_size)
    epoch = index = 0
    losses, evals = [], [heldout_loss(model, val)]
    for _ in range(cfg.dp_steps):
        batch, epoch, index = batch_at(seqs, epoch, index, cfg.dp_batch_size, cfg.seed)
        losses.append(float(train_step(model, optimizer, jnp.asarray(batch), cfg.dp_microbatches)))
    evals.append(heldout_loss(model, val))
    return {"train_loss": losses, "heldout_loss": evals}


def run_lockstep(cfg, run_dir: Path) -> dict:
    import jax.numpy as jnp
    from flax import nnx

    from diloco.exchange import Submission
    from diloco.fragments import balanced_fragments, fragments_due
    from diloco.params import embedding_names, get_params, set_params, tensor_bytes, to_numpy
    from diloco.syncer import Syncer, SyncerSettings
    from models.training import heldout_loss, make_inner_tx, train_step, val_batches
    from tasks.data import batch_at, load_manifest, load_sequences
    from tasks.pretrain import _model_factory

    d = cfg.diloco
    M = d.learners
    factory = _model_factory(cfg, int(load_manifest(run_dir)["vocab_size"]))
    learners = [factory() for _ in range(M)]
    theta0 = to_numpy(get_params(learners[0]))
    fragments = balanced_fragments(tensor_bytes(theta0), d.fragments)
    syncer = Syncer(theta0, fragments, SyncerSettings(
        num_learners=M, quorum=M, grace_s=0.0, merge=d.merge, outer_lr=d.outer_lr,
        outer_momentum=d.outer_momentum, outer_nesterov=d.outer_nesterov, max_staleness=0,
    ), embedding_names(theta0))
    tx = make_inner_tx(d.inner, cfg.learner_steps)
    optimizers = [nnx.Optimizer(model, tx, wrt=nnx.Param) for model in learners]
    shards = [load_sequences(run_dir, f"shard_{m:02d}") for m in range(M)]
    cursors = [(0, 0)] * M
    since = [[0] * len(fragments) for _ in range(M)]  # inner steps since fragment p was received
    eval_model = factory()
    val = val_batches(load_sequences(run_dir, "val"), cfg.train.eval_batches, cfg.train.eval_batch_size)
    losses, merges = [], []
    tps = cfg.tokens_per_learner_step
    for step in range(1, cfg.learner_steps + 1):
        row = []
        for m, model in enumerate(learners):
            batch, *cursors[m] = batch_at(shards[m], *cursors[m], batch_size=d.batch_size,
                                          seed=cfg.seed + 1000 * (m + 1))
            row.append(float(train_step(model, optimizers[m], jnp.asarray(batch), cfg.learner_microbatches)))
            since[m] = [s + 1 for s in since[m]]
        losses.append(row)
        due = fragments_due(step, len(fragments), d.sync_every)
        if step == cfg.learner_steps:
            due = list(range(len(fragments)))
        for p in due:
            for m, model in enumerate(learners):
                cur = get_params(model)
                syncer.receive(Submission(
                    learner=m, fragment=p, params=to_numpy({k: cur[k] for k in fragments[p]}),
                    tokens=since[m][p] * tps, steps=since[m][p], base_version=syncer.versions[p],
                    local_step=step), 0.0)
            records = syncer.poll(0.0, set(range(M)))
            assert [r["fragment"] for r in records] == [p], records
            merges.append({"step": step, "fragment": p, "outer_grad_norm": records[0]["outer_grad_norm"]})
            for m, model in enumerate(learners):
                set_params(model, syncer.global_params[p])
                since[m][p] = 0
    set_params(eval_model, syncer.params())
    return {"train_loss": losses, "merges": merges, "heldout_loss": [heldout_loss(eval_model, val)]}


def run_all() -> dict[str, dict]:
    from tasks.data import prepare_data

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
            print(f"{name}: held-out loss {got['heldout_loss']} (recorded {want['heldout_loss']})")
        else:
            print(f"{name}: held-out loss {got['heldout_loss']} (nothing recorded yet)")


if __name__ == "__main__":
    main()
