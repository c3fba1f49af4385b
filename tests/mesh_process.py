"""One learner-style Trainer on 2 devices against 1 device, in a process of its own (tests/test_mesh.py).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/mesh_process.py

The flag must be set before JAX starts, hence a process of its own. The tiny config's model
(configs/tiny.yaml: 2 layers, d_model 32, vocabulary 512, 32 tokens per row) and its inner
optimizer (AdamW, warmup, clipping), the same initial parameters and the same 10 batches of 4 rows
(random token ids, seeded), stepped as the learner loop steps: batches as ``jnp.asarray`` of host
numpy, one as host numpy, one committed to device 0, and a "pull" at step 5 that replaces one
tensor by an uncommitted copy. Without microbatches (G = 1) the one-device trainer is the default
device's (plain ``jax.jit``); with G = 2 it is device 1's (inputs placed there). Prints one JSON
object: per-step losses, the devices holding the outputs, evaluations (G = 1) and the collectives
of the two-device step (G = 2).
"""

import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs.load import load_config  # noqa: E402
from models import InputShape, build_model  # noqa: E402
from training.optimizers import make_inner_tx  # noqa: E402
from training.step import Trainer  # noqa: E402

STEPS, B = 10, 4


def run(trainer: Trainer, batches: list[np.ndarray], evaluate: bool) -> dict:
    params = trainer.init_params()
    opt = trainer.init_opt(params)
    losses = []
    for i, batch in enumerate(batches, start=1):
        if i == 3:
            fed = batch  # host numpy
        elif i == 4 and trainer.devices is not None:
            # committed to device 0 (not for the default device's plain jit: a committed argument is
            # another compilation there, and it would only follow the batch to device 0)
            fed = jax.device_put(batch, jax.devices()[0])
        else:
            fed = jnp.asarray(batch)  # as the learner loop does
        if i == 5:  # a pull: one tensor replaced by an uncommitted array (jnp.asarray of numpy)
            name = sorted(params)[0]
            params = {**params, name: jnp.asarray(np.asarray(params[name]))}
        params, opt, metrics = trainer.step(params, opt, fed)
        losses.append(float(metrics["loss"]))
    leaf = params[sorted(params)[-1]]
    out = {
        "losses": losses,
        "params": {k: np.asarray(v) for k, v in params.items()},
        "param_devices": sorted({d.id for v in params.values() for d in v.sharding.device_set}),
        "params_replicated": all(v.sharding.is_fully_replicated for v in params.values()),
        "opt_devices": sorted({d.id for x in jax.tree.leaves(opt) for d in x.sharding.device_set}),
        "metric_devices": sorted(d.id for d in metrics["loss"].sharding.device_set),
        "leaf_shards": len(leaf.addressable_shards),
    }
    if evaluate:
        out["eval"] = float(trainer.evaluate(params, jnp.asarray(batches[0]))["loss"])
        out["eval_odd_rows"] = float(trainer.evaluate(params, batches[1][:3])["loss"])  # 3 rows: not split
    return out


def collectives(trainer: Trainer, batch: np.ndarray) -> dict[str, int]:
    """Collective ops in the two-device step's compiled program (read from the compilation cache
    that :func:`main` sets up: the calls above compiled it)."""
    params = trainer.init_params()
    text = trainer.step.jitted.lower(params, trainer.init_opt(params), batch, {}).compile().as_text()
    ops = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
    out = {op: len(re.findall(rf"\b{op}(?:-start)?\(", text)) for op in ops}
    # all-reduces inside a loop's body (the microbatch scan): once per microbatch instead of per step
    bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", text))
    blocks = re.split(r"\n(?=\S)", text)  # one computation per block: "name (…) -> … {" … "}"
    out["all-reduce in loops"] = sum(
        len(re.findall(r"\ball-reduce(?:-start)?\(", b)) for b in blocks if b.split(" ", 1)[0].lstrip("%") in bodies
    )
    return out


def main() -> None:
    # A compilation cache in a temporary folder, so that compiling the step again to read its
    # collectives is a lookup (about 0.7 s instead of 5 s on 2 CPU cores).
    with tempfile.TemporaryDirectory(prefix="mesh-jax-cache-") as cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        print(json.dumps(compare()))


def compare() -> dict:
    """The runs of the module docstring; returns what main prints."""
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    spec = build_model(cfg.model, InputShape(vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len))
    tx = make_inner_tx(cfg.diloco.inner, STEPS)
    rng = np.random.default_rng(0)
    batches = [
        rng.integers(0, cfg.data.vocab_size, size=(B, cfg.data.seq_len + 1), dtype=np.int32) for _ in range(STEPS)
    ]
    devs = jax.devices()
    out: dict = {"devices": len(devs)}
    for G, single in ((1, devs[:1]), (2, devs[1:2])):
        one = run(Trainer(spec, tx, G, seed=cfg.seed, devices=single), batches, evaluate=G == 1)
        two_trainer = Trainer(spec, tx, G, seed=cfg.seed, devices=devs[:2])
        two = run(two_trainer, batches, evaluate=G == 1)
        diff = max(float(np.max(np.abs(one["params"][k] - two["params"][k]))) for k in one["params"])
        for r in (one, two):
            del r["params"]
        out[f"G{G}"] = {"one": one, "two": two, "final_param_max_abs_diff": diff}
        if G == 2:
            out[f"G{G}"]["collectives"] = collectives(two_trainer, batches[0])
    return out


if __name__ == "__main__":
    main()
