"""The pipeline with M = 2 learners × 2 devices on 4 simulated CPU devices, in a process of its own.

    python tests/mesh_pipeline.py [RUN_DIR]

Sets ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before JAX starts, then runs the
pipeline flow as ``ddiloco run`` does (preflight, then ``flows.pipeline.pipeline``; threads engine)
on the tiny config and the committed small corpus, cut to one eval interval with no lm-eval and
no post-training (the FAST overrides of tests/test_deployments.py), but with the DP baseline on:
learners 0 and 1 train on devices {0, 1} and {2, 3}, the DP baseline on all 4. Learner 1 fails at
its step 6 and resumes from its resume point of step 4 (restored onto the default device and
placed on its mesh again by the step). Prints one JSON object: the held-out losses (first and last
evaluation of each method), tokens, the device slices of the learners' compiled steps, learner
1's restart, and the wall time; exits non-zero if the run did not complete.

Not part of the suite: about 75 s on 2 busy CPU cores (Prefect's temporary server included).
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("TQDM_DISABLE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OVERRIDES = {
    "data.source": "local",
    "data.paths": [str(ROOT / "tests" / "data" / "shakespeare_small.jsonl")],
    "train.token_budget": 3072,
    "train.eval_every_tokens": 3072,
    "eval.enabled": False,
    "finetune.enabled": False,
    "diloco.learners": 2,
    "diloco.quorum": 2,
    "runtime.devices_per_learner": 2,
    "chaos.events": [{"kind": "fail", "learner": 1, "at_step": 6}],
    "diloco.resume_every_steps": 4,
    "diloco.retry_delay_s": 0.5,
}


def main() -> None:
    t0 = time.monotonic()
    import jax

    from configs.load import load_config
    from flows.pipeline import pipeline
    from flows.preflight import preflight
    from run.layout import RunLayout
    from run.metrics import read_jsonl
    from training.decoupled import setup

    assert len(jax.devices()) == 4, jax.devices()
    cfg = load_config(ROOT / "configs" / "tiny.yaml", OVERRIDES)
    run_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="mesh-pipeline-")) / "run"
    rd = preflight(cfg, run_dir)
    pipeline(config=cfg, run_dir=str(rd))
    layout = RunLayout(rd)
    out: dict = {"run_dir": str(rd), "devices": len(jax.devices())}
    for method in ("diloco", "dp"):
        curve = read_jsonl(layout.metrics("pretrain", method, "eval"))
        summary = json.loads(layout.summary("pretrain", method).read_text())
        out[method] = {
            "heldout_first": curve[0]["val/loss"],
            "heldout_last": curve[-1]["val/loss"],
            "final_val_loss": summary["final_val_loss"],
            "tokens": summary["tokens"],
            "steps": summary["steps"],
            "hyperparameters": summary["hyperparameters"],
        }
    out["learner_slices"] = sorted(key[2] for key in setup.CACHE.trainers if key[2] is not None)
    events = read_jsonl(layout.metrics("pretrain", "diloco", "learners"))
    out["learner_1_restart"] = [
        {k: e.get(k) for k in ("event", "attempt", "step", "resumed")}
        for e in events
        if e.get("learner") == 1 and e.get("event") in ("failure", "start")
    ]
    out["status"] = json.loads(layout.status.read_text())
    out["wall_s"] = time.monotonic() - t0
    print(json.dumps(out))
    restarts = [e for e in out["learner_1_restart"] if e["event"] == "start" and e["attempt"] == 2]
    ok = (
        out["status"]["status"] == "completed"
        and len(out["learner_slices"]) == 2
        and restarts
        and restarts[0]["resumed"]
        and restarts[0]["step"] == 4
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
