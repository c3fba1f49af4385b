"""Compile in this process with the run's compilation cache and report JAX's cache events
(tests/test_compile_cache.py).

    python tests/compile_process.py INPUTS.pkl warm|learner

INPUTS.pkl holds ``{"config": ExperimentConfig, "run_dir": str}``. ``warm``: the flow's
``training.decoupled.setup.warm_compilation_cache``; ``learner``: what a learner process compiles (its
trainer on its own device slice, one step, one evaluation batch). Prints one JSON line: the cache
folder in use and the counts of JAX's ``/jax/compilation_cache/*`` monitoring events.
"""

import collections
import json
import os
import pickle
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

EVENTS: collections.Counter = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: EVENTS.update([name]))

from data.cursor import batch_at  # noqa: E402
from data.prepare import load_rows  # noqa: E402
from training import xla  # noqa: E402
from training.decoupled.plan import DiLoCoPlan  # noqa: E402
from training.decoupled.setup import learner_trainer, warm_compilation_cache  # noqa: E402
from training.evaluation import heldout_metrics, val_batches  # noqa: E402
from training.mesh import learner_devices  # noqa: E402

if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        inputs = pickle.load(f)
    cfg, run_dir = inputs["config"], inputs["run_dir"]
    if sys.argv[2] == "warm":
        warm_compilation_cache(cfg, run_dir)
    else:
        trainer = learner_trainer(DiLoCoPlan.of(cfg), run_dir, learner_devices(1, cfg.runtime.devices_per_learner))
        params = trainer.init_params()
        opt = trainer.init_opt(params)
        heldout_metrics(trainer.evaluate, params, val_batches(load_rows(run_dir, "val"), 1, cfg.train.eval_batch_size))
        batch, _, _ = batch_at(load_rows(run_dir, "shard_01"), 0, 0, batch_size=cfg.diloco.batch_size, seed=7)
        jax.block_until_ready(trainer.step(params, opt, jax.tree.map(jnp.asarray, batch))[2]["loss"])
    cache = {k.rsplit("/", 1)[-1]: v for k, v in EVENTS.items() if k.startswith("/jax/compilation_cache/")}
    folder = xla._cache_dir if isinstance(xla._cache_dir, str) else None  # None: off, or never set
    print(json.dumps({"dir": folder, "events": cache}))
