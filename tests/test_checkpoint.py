"""Orbax checkpoints: round trip, and a clear error for a missing or incomplete checkpoint."""

import numpy as np
import pytest
from flax import nnx

from configs.schema import ModelConfig
from diloco.params import get_params
from models import build_model
from models.checkpoint import CheckpointError, latest_step, load_into_model, load_meta, save_checkpoint

CFG = ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32)


def test_round_trip(tmp_path):
    a = build_model(CFG, 40, 8, nnx.Rngs(1))
    save_checkpoint(tmp_path / "ck", 7, nnx.to_pure_dict(nnx.state(a, nnx.Param)), {"method": "dp", "tokens": 7})
    b = build_model(CFG, 40, 8, nnx.Rngs(2))
    meta = load_into_model(tmp_path / "ck", b)
    assert meta == {"method": "dp", "tokens": 7} and load_meta(tmp_path / "ck")["tokens"] == 7
    pa, pb = get_params(a), get_params(b)
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)


def test_missing_and_incomplete_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        latest_step(tmp_path / "nope")
    ck = tmp_path / "ck"
    # What an interrupted Orbax save leaves: only a temporary folder, never a finalized step.
    (ck / "5.orbax-checkpoint-tmp-1234" / "params").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_into_model(ck, build_model(CFG, 40, 8, nnx.Rngs(0)))


def test_mismatched_model_is_a_clear_error(tmp_path):
    a = build_model(CFG, 40, 8, nnx.Rngs(1))
    save_checkpoint(tmp_path / "ck", 1, nnx.to_pure_dict(nnx.state(a, nnx.Param)), {})
    bigger = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=32), 40, 8, nnx.Rngs(0))
    with pytest.raises(CheckpointError, match="cannot restore"):
        load_into_model(tmp_path / "ck", bigger)


def test_existing_step_is_never_overwritten(tmp_path):
    a = build_model(CFG, 40, 8, nnx.Rngs(1))
    pure = nnx.to_pure_dict(nnx.state(a, nnx.Param))
    save_checkpoint(tmp_path / "ck", 3, pure, {"v": "first"})
    with pytest.raises(FileExistsError, match="never overwritten"):
        save_checkpoint(tmp_path / "ck", 3, pure, {"v": "second"})
    assert load_meta(tmp_path / "ck") == {"v": "first"}
