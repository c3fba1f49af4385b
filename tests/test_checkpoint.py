"""Orbax checkpoints: round trip, a clear error for a missing or incomplete checkpoint, and damaged
steps (missing / truncated / corrupted files) reported as DAMAGED, apart from a model mismatch."""

import json
import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model import DenseLMConfig
from models import InputShape, build_model
from training.checkpoint import (
    INTEGRITY_FILE,
    CheckpointDamaged,
    CheckpointError,
    latest_step,
    load_extra,
    load_into_model,
    load_meta,
    save_checkpoint,
    verify_step,
)
from training.functional import params_of

CFG = DenseLMConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32)
SHAPE = InputShape(vocab_size=40, seq_len=8)
# When Orbax aborts a restore (bad file, wrong shape) it leaves read coroutines that are never awaited;
# Python reports them as "Exception ignored in <coroutine ...>". That is Orbax's noise, not ours.
ORBAX_ABORTED_RESTORE = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
pytestmark = ORBAX_ABORTED_RESTORE


@pytest.fixture(autouse=True)
def _collect_orbax_leftovers():
    """Collect those coroutines inside the test, where the mark above applies, instead of at
    interpreter exit (where they would print after pytest's summary line)."""
    import gc

    yield
    gc.collect()


def _model(seed, cfg=CFG):
    return build_model(cfg, SHAPE).init(seed)


def _pure(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _same_params(a, b):
    pa, pb = params_of(a), params_of(b)
    return pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)


def _largest_file(folder):
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _two_steps(ck):
    """Steps 1 and 2 of two different models, each with an extra pytree; returns the models."""
    a, b = _model(1), _model(2)
    save_checkpoint(ck, 1, _pure(a), {"tokens": 1}, extra={"outer_state": {"x": jnp.full((4,), 1.0)}})
    save_checkpoint(ck, 2, _pure(b), {"tokens": 2}, extra={"outer_state": {"x": jnp.full((4,), 2.0)}})
    return a, b


def test_round_trip(tmp_path, caplog):
    ck = tmp_path / "ck"
    a = _model(1)
    step_dir = save_checkpoint(ck, 7, _pure(a), {"method": "dp", "tokens": 7})
    # The integrity record lists every file of the step with its size and sha256.
    record = json.loads((step_dir / INTEGRITY_FILE).read_text())
    on_disk = {
        p.relative_to(step_dir).as_posix(): p.stat().st_size
        for p in step_dir.rglob("*")
        if p.is_file() and p.name != INTEGRITY_FILE
    }
    assert {k: v["size"] for k, v in record["files"].items()} == on_disk
    assert all(len(v["sha256"]) == 64 for v in record["files"].values())
    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        b = _model(2)
        meta = load_into_model(ck, b)
        assert meta == {"method": "dp", "tokens": 7} and load_meta(ck)["tokens"] == 7
        assert latest_step(ck) == 7
        verify_step(ck, 7)
    assert _same_params(a, b)
    assert not [r for r in caplog.records if r.name == "training.checkpoint"]
    # Orbax tolerates the record: later saves, max_to_keep=2 clean-up and explicit steps still work.
    save_checkpoint(ck, 8, _pure(_model(3)), {"tokens": 8})
    save_checkpoint(ck, 9, _pure(b), {"tokens": 9}, extra={"outer_state": {"x": jnp.arange(4.0)}})
    assert sorted(p.name for p in ck.iterdir()) == ["8", "9"] and latest_step(ck) == 9
    verify_step(ck, 8)
    verify_step(ck, 9)
    c = _model(4)
    assert load_into_model(ck, c, step=9) == {"tokens": 9} and _same_params(b, c)
    assert np.array_equal(load_extra(ck, "outer_state", {"x": jnp.zeros(4)})["x"], np.arange(4.0))


def test_truncated_newest_step_falls_back_to_older_step_with_warning(tmp_path, caplog):
    ck = tmp_path / "ck"
    a, _ = _two_steps(ck)
    victim = _largest_file(ck / "2" / "params")
    rel = victim.relative_to(ck / "2").as_posix()
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        assert latest_step(ck) == 1
        assert load_meta(ck) == {"tokens": 1}
        fresh = _model(9)
        assert load_into_model(ck, fresh) == {"tokens": 1}
        assert float(load_extra(ck, "outer_state", {"x": jnp.zeros(4)})["x"][0]) == 1.0
    assert _same_params(a, fresh)
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "training.checkpoint"
    ]
    assert len(warnings) == 4
    assert all("step 2" in w and rel in w and "truncated" in w for w in warnings)
    # An explicitly requested damaged step is an error, not a silent fallback.
    with pytest.raises(CheckpointDamaged, match=f"step 2 .*{rel}") as info:
        load_into_model(ck, _model(9), step=2)
    assert info.value.step == 2 and info.value.file == rel
    with pytest.raises(CheckpointDamaged, match="step 2"):
        verify_step(ck, 2)


def test_corrupted_same_size_file_is_damaged(tmp_path, caplog):
    ck = tmp_path / "ck"
    _two_steps(ck)
    victim = _largest_file(ck / "2" / "outer_state")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        assert load_meta(ck) == {"tokens": 1}
    assert any("step 2" in r.getMessage() and "corrupted" in r.getMessage() for r in caplog.records)


def test_deleted_file_of_only_step_is_reported_damaged(tmp_path):
    ck = tmp_path / "ck"
    save_checkpoint(ck, 5, _pure(_model(1)), {"tokens": 5})
    victim = _largest_file(ck / "5" / "params")
    rel = victim.relative_to(ck / "5").as_posix()
    victim.unlink()
    for load in (
        lambda: load_into_model(ck, _model(2)),
        lambda: load_meta(ck),
        lambda: latest_step(ck),
        lambda: load_into_model(ck, _model(2), step=5),
    ):
        with pytest.raises(CheckpointDamaged, match="DAMAGED") as info:
            load()
        msg = str(info.value)
        assert "step 5" in msg and rel in msg and "missing" in msg
        assert info.value.step == 5 and info.value.file == rel
    assert "re-run pretraining" in str(pytest.raises(CheckpointDamaged, load_meta, ck).value)


@ORBAX_ABORTED_RESTORE
def test_step_without_integrity_record_is_checked_as_far_as_possible(tmp_path, caplog):
    """Steps saved before integrity records existed: an Orbax read/decode error is damage, too."""
    ck = tmp_path / "ck"
    a, _ = _two_steps(ck)
    for step in ("1", "2"):
        (ck / step / INTEGRITY_FILE).unlink()
    victim = _largest_file(ck / "2" / "params")
    victim.write_bytes(victim.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        fresh = _model(9)
        assert load_into_model(ck, fresh) == {"tokens": 1}
    assert _same_params(a, fresh)
    assert any("step 2" in r.getMessage() and "params/" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointDamaged, match="step 2"):
        load_into_model(ck, _model(9), step=2)
    # An emptied metadata file is named exactly.
    (ck / "1" / "meta" / "metadata").write_bytes(b"")
    with pytest.raises(CheckpointDamaged, match="step 2.*DAMAGED") as info:
        load_into_model(ck, _model(9))
    assert info.value.step == 2
    with pytest.raises(CheckpointDamaged, match="meta/metadata"):
        load_meta(ck, step=1)


def test_missing_and_incomplete_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        latest_step(tmp_path / "nope")
    ck = tmp_path / "ck"
    # What an interrupted Orbax save leaves: only a temporary folder, never a finalized step.
    (ck / "5.orbax-checkpoint-tmp-1234" / "params").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_into_model(ck, _model(0))


@ORBAX_ABORTED_RESTORE
def test_mismatched_model_is_a_clear_error_not_damage(tmp_path):
    a = _model(1)
    save_checkpoint(tmp_path / "ck", 1, nnx.to_pure_dict(nnx.state(a, nnx.Param)), {})
    bigger = _model(0, DenseLMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=32))
    with pytest.raises(CheckpointError, match="cannot restore.*does not match this model") as info:
        load_into_model(tmp_path / "ck", bigger)
    assert not isinstance(info.value, CheckpointDamaged)
    # Same without an integrity record (a step written before records existed).
    (tmp_path / "ck" / "1" / INTEGRITY_FILE).unlink()
    with pytest.raises(CheckpointError, match="does not match this model") as info:
        load_into_model(tmp_path / "ck", bigger)
    assert not isinstance(info.value, CheckpointDamaged)
    with pytest.raises(CheckpointError, match="does not match") as info:
        load_extra(tmp_path / "ck", "params", {"nope": jnp.zeros(3)})
    assert not isinstance(info.value, CheckpointDamaged)


def test_existing_step_is_never_overwritten(tmp_path):
    a = _model(1)
    pure = nnx.to_pure_dict(nnx.state(a, nnx.Param))
    save_checkpoint(tmp_path / "ck", 3, pure, {"v": "first"})
    with pytest.raises(FileExistsError, match="never overwritten"):
        save_checkpoint(tmp_path / "ck", 3, pure, {"v": "second"})
    assert load_meta(tmp_path / "ck") == {"v": "first"}


def test_extra_tree_without_arrays_is_intact_without_a_record(tmp_path):
    """Outer SGD without momentum has an empty state: Orbax writes no data files for it, and a step
    saved before integrity records existed must still read as intact."""
    a = _model(1)
    save_checkpoint(
        tmp_path / "ck", 7, _pure(a), {"tokens": 7}, extra={"outer_state": {"fragment_0": {}, "fragment_1": {}}}
    )
    (tmp_path / "ck" / "7" / INTEGRITY_FILE).unlink()
    verify_step(tmp_path / "ck", 7)
    fresh = _model(9)
    assert load_into_model(tmp_path / "ck", fresh) == {"tokens": 7} and _same_params(a, fresh)


def test_step_without_params_holds_only_meta_and_extras(tmp_path):
    """``params=None`` (a learner's resume point: optimizer state and cursor, no model): the step
    is intact and readable, and restoring a model from it is a clear error, not damage."""
    ck = tmp_path / "ck"
    step_dir = save_checkpoint(ck, 4, None, {"step": 4}, extra={"opt_state": {"mu": jnp.arange(3.0)}})
    assert not (step_dir / "params").exists()
    verify_step(ck, 4)
    assert latest_step(ck) == 4 and load_meta(ck) == {"step": 4}
    assert np.array_equal(load_extra(ck, "opt_state", {"mu": jnp.zeros(3)})["mu"], np.arange(3.0))
    with pytest.raises(CheckpointError, match="has no item 'params'") as info:
        load_into_model(ck, _model(0))
    assert not isinstance(info.value, CheckpointDamaged)


def test_resume_points_are_written_in_the_background_and_flushed(tmp_path):
    """``save`` hands the state over and returns; the state is copied first (the next step donates
    its buffers), ``load`` sees the last save, and a failed write is raised by ``flush``."""
    from diloco.learner import ResumePoint
    from training.checkpoint import OrbaxResumeStore

    state = {"mu": jnp.arange(6, dtype=jnp.float32), "count": jnp.asarray(3, jnp.int32)}
    store = OrbaxResumeStore(tmp_path / "resume")
    mutable = {"mu": np.arange(6, dtype=np.float32), "count": np.asarray(3, np.int32)}
    store.save(ResumePoint(step=5, cursor=(0, 40), tokens=5120, opt_state=mutable))
    mutable["mu"][:] = -1  # what a donated buffer reused by the next step would look like
    store.save(ResumePoint(step=10, cursor=(1, 2), tokens=10240, opt_state=state))
    got = OrbaxResumeStore(tmp_path / "resume")
    store.flush()
    point = got.load(state)
    assert (point.step, point.cursor, point.tokens) == (10, (1, 2), 10240)
    np.testing.assert_array_equal(point.opt_state["mu"], np.arange(6))
    assert latest_step(tmp_path / "resume") == 10
    older = load_extra(tmp_path / "resume", "opt_state", state, 5)
    np.testing.assert_array_equal(older["mu"], np.arange(6))  # the copy, not the overwritten array

    (tmp_path / "afile").write_text("x")
    bad = OrbaxResumeStore(tmp_path / "afile" / "resume")
    bad.save(ResumePoint(step=1, cursor=(0, 0), tokens=1, opt_state=state))
    with pytest.raises(NotADirectoryError):
        bad.flush()
    bad.flush()  # raised once; the store is usable again
