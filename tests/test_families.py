"""Every model family through the whole pipeline (shard → DiLoCo and DP → evaluation → report), on
tiny configs: the MoE LM on the committed small corpus, the ViT and V-MoE on scikit-learn's digits."""

import json
import shutil

import pytest

from run.layout import RunLayout
from run.metrics import read_jsonl
from tests.conftest import squash

VISION = {
    "data": {"source": "digits"},
    "diloco": {
        "learners": 3,
        "fragments": 3,
        "sync_every": 4,
        "quorum": 2,
        "grace_s": 0.5,
        "batch_size": 16,
        "receipt": "keep_in_flight",
        "outer_lr": 0.8,
        "outer_momentum": 0.0,
        "inner": {"lr": 0.003, "warmup_steps": 5},
    },
    "dp": {"batch_size": 48, "workers": 3, "inner": {"lr": 0.003, "warmup_steps": 5}},
    "train": {"token_budget": 9600, "eval_every_tokens": 4800, "eval_batches": 2, "eval_batch_size": 64},
}


def _run(cfg, tmp_path):
    from flows.pipeline import pipeline

    run_dir = tmp_path / "run"
    assert pipeline(config=cfg, run_dir=str(run_dir)) == str(run_dir)
    return RunLayout(run_dir)


@pytest.mark.slow
def test_moe_lm_end_to_end(prefect_harness, small_cfg, small_data, tmp_path):
    from configs.schema import ExperimentConfig

    cfg = ExperimentConfig.model_validate(
        {
            **small_cfg.model_dump(),
            "model": {**small_cfg.model.model_dump(), "kind": "moe_lm", "n_experts": 4, "top_k": 2, "moe_every": 2},
        }
    )
    shutil.copytree(small_data / "data", tmp_path / "run" / "data")
    layout = _run(cfg, tmp_path)
    for method in ("diloco", "dp"):
        curve = read_jsonl(layout.metrics("pretrain", method, "eval"))
        assert curve[-1]["val/loss"] < curve[0]["val/loss"] - 0.2
        assert curve[-1]["val/loss"] == pytest.approx(curve[-1]["val/ce"])  # held-out loss: the CE alone
        loads = [curve[-1][f"val/moe/1/load/{e}"] for e in range(4)]
        assert sum(loads) == pytest.approx(1.0, abs=1e-5)
        assert "heldout_nextline/acc" in json.loads(layout.eval_result("pretrain", method).read_text())
    report = squash(layout.report_md.read_text())
    assert "### Experts (mixture of experts)" in report and "| Decoupled DiLoCo | 2 |" in report
    summary = json.loads(layout.summary("pretrain", "dp").read_text())
    assert summary["params"] - summary["active_params"] == 2 * 3 * 32 * 64  # 2 of 4 experts idle per token
    assert "active parameters per token (MoE: k of E experts)" in report
    assert (layout.report / "pretrain_expert_load.png").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    "model",
    [
        {"kind": "vit", "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "patch_size": 4},
        {
            "kind": "vit_moe",
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 2,
            "d_ff": 64,
            "patch_size": 4,
            "n_experts": 4,
            "top_k": 1,
            "pool": "mean",
        },
    ],
)
def test_vision_end_to_end(prefect_harness, model, tmp_path):
    from configs.schema import ExperimentConfig

    finetune = {
        "finetune": {
            "enabled": True,
            "steps": 40,
            "batch_size": 32,
            "eval_every_steps": 20,
            "seeds": [0],
            "max_test_items": 400,
            "optimizer": {"lr": 0.003, "warmup_steps": 5},
        }
    }
    cfg = ExperimentConfig.model_validate(
        {**VISION, "name": f"{model['kind']}-test", "model": model, **(finetune if model["kind"] == "vit" else {})}
    )
    layout = _run(cfg, tmp_path)
    manifest = json.loads((layout.root / "data" / "manifest.json").read_text())
    assert manifest["modality"] == "image" and manifest["image_shape"] == [8, 8, 1]
    for method in ("diloco", "dp"):
        summary = json.loads(layout.summary("pretrain", method).read_text())
        assert summary["tokens"] == 9600  # images
        result = json.loads(layout.eval_result("pretrain", method).read_text())
        assert result["test/images"] == 360 and result["test/accuracy"] > 0.5  # chance is 0.1
        assert sum(map(sum, result["confusion"])) == 360
    report = squash(layout.report_md.read_text())
    assert "### Evaluation (held-out test images)" in report and "budget per method (images)" in report
    assert (layout.report / "pretrain_confusion.png").is_file()
    if model["kind"] == "vit_moe":
        assert "### Experts (mixture of experts)" in report
    else:  # post-training: a new 4-way head on the pretrained backbone learns the images' rotation
        for method in ("diloco", "dp"):
            result = json.loads(layout.eval_result("finetune", method).read_text())
            # the fresh head scores the share of the 0° items (400 drawn of 4 × 360 test items)
            assert result["task"]["name"] == "rotation"
            assert result["pretrained"]["metrics"]["accuracy"] == pytest.approx(0.25, abs=0.05)
            assert result["finetuned"][0]["metrics"]["accuracy"] > 0.4  # chance: 0.25
        assert "## Post-training" in report
