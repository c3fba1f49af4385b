"""Fine-tuning's plain parts: the task data, the response-only loss, the loaders' refusals, LoRA
touching only its adapters, and one identical recipe for every method."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from data import finetune as F

PLAY = """THE TEST PLAY

ACT I. SCENE I. A street.

Enter ROMEO and NURSE.

ROMEO.
What light through yonder window breaks?
It is the east.

Nurse.
Madam, your mother craves a word with you.

[Exit.]

JULIET
O Romeo, Romeo!
[Aside.]
Deny thy father.
"""


def _byte_tokenizer():
    """A byte-level BPE without merges: one token per byte, so tokens can be counted by hand."""
    from data.text import train_tokenizer

    return train_tokenizer(["abc"], vocab_size=257)


def test_speaker_pairs_read_headings_in_every_spelling_and_skip_stage_directions():
    pairs = F.speaker_pairs([{"title": "Test", "text": PLAY}], context=1, speech_lines=2)
    assert [p["speaker"] for p in pairs] == ["ROMEO", "Nurse", "JULIET"]
    assert [p["response"] for p in pairs] == [" ROMEO\n", " Nurse\n", " JULIET\n"]
    # the first speech follows a stage direction: no context line
    assert pairs[0]["prompt"] == "Test\n?: What light through yonder window breaks? / It is the east.\nSpeaker:"
    # the second follows ROMEO's speech: its last line, with its speaker
    assert pairs[1]["prompt"] == (
        "Test\nROMEO: It is the east.\n?: Madam, your mother craves a word with you.\nSpeaker:"
    )
    # the third follows an exit: no context; a bracketed stage direction inside a speech is not speech
    assert pairs[2]["prompt"] == "Test\n?: O Romeo, Romeo! / Deny thy father.\nSpeaker:"
    assert len({p["id"] for p in pairs}) == 3 and [p["two_back"] for p in pairs] == [None, None, None]


def test_speaker_prompts_show_the_speeches_before_with_their_speakers():
    text = "A.\nOne.\n\nB.\nTwo, and\nthen three.\n\nA.\nFour.\n"
    pairs = F.speaker_pairs([{"title": "T", "text": text}], context=2)
    assert pairs[2]["prompt"] == "T\nA: One.\nB: then three.\n?: Four.\nSpeaker:"
    assert [p["two_back"] for p in pairs] == [None, None, "A"] and pairs[2]["response"] == " A\n"


def test_the_loss_mask_covers_the_response_tokens_only():
    """Hand-counted: one token per byte, the prompt "Who?\\nSpeaker:" is 13 tokens, the response
    " BOB\\n" 5; with a 24-token row the mask is 1 exactly at positions 13..17 and at the EOT
    closing the response (18: the stop token is a target, issue 25)."""
    tok = _byte_tokenizer()
    pair = {"id": "0", "prompt": "Who?\nSpeaker:", "response": " BOB\n"}
    prompt, response = F.encode_pair(tok, pair)
    assert (len(prompt), len(response)) == (13, 5)
    ids, mask, info = F.pack_rows([(prompt, response)], 24, eot_id=0)
    assert ids.shape == mask.shape == (1, 24) and ids.dtype == np.int32
    assert mask[0].tolist() == [0] * 13 + [1] * 6 + [0] * 5
    assert ids[0, 13:18].tolist() == tok.encode(" BOB\n").ids and (ids[0, 18:] == 0).all()
    assert info["response_tokens"] == 5 and info["target_tokens"] == 6
    # packing: two pairs in one row, each closed by its EOT (a target), the masks carried with them
    ids, mask, _ = F.pack_rows([(prompt, response), (prompt, response)], 40, eot_id=0, packing=True)
    assert ids.shape == (1, 40)
    assert mask[0].tolist() == ([0] * 13 + [1] * 6) * 2 + [0] * 2
    # too long: the prompt loses tokens from the left, the response and its stop token are kept whole
    ids, mask, info = F.pack_rows([(prompt, response)], 10, eot_id=0)
    assert mask[0].tolist() == [0] * 4 + [1] * 6 and info["truncated_prompts"] == 1


def test_the_fine_tuning_loss_is_the_cross_entropy_of_the_masked_tokens():
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from configs.model import DenseLMConfig
    from models.text.dense import DecoderLM, lm_objective

    cfg = DenseLMConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32)
    model = DecoderLM(cfg, vocab_size=257, max_len=24, rngs=nnx.Rngs(0))
    tok = _byte_tokenizer()
    ids, mask, _ = F.pack_rows([F.encode_pair(tok, {"prompt": "Who?\nSpeaker:", "response": " BOB\n"})], 24, 0)
    loss, _ = lm_objective(model, {"ids": jnp.asarray(ids), "mask": jnp.asarray(mask)})
    logits = model(jnp.asarray(ids[:, :-1]))
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(ids[:, 1:]))[0]
    assert float(loss) == pytest.approx(float(nll[12:18].mean()), rel=1e-5)  # targets 13..18 = inputs 12..17
    # without a mask, the plain packed-batch loss (all 23 targets)
    full, _ = lm_objective(model, jnp.asarray(ids))
    assert float(full) == pytest.approx(float(nll.mean()), rel=1e-4)


def test_jsonl_pairs_load_and_bad_files_are_refused_in_one_line(tmp_path):
    good = tmp_path / "pairs.jsonl"
    good.write_text('{"q": "2+2=", "a": " 4\\n"}\n\n{"q": "3+3=", "a": " 6\\n", "id": "x"}\n')
    pairs = F.load_jsonl_pairs(good, "q", "a")
    assert pairs == [
        {"id": "0", "prompt": "2+2=", "response": " 4\n"},
        {"id": "x", "prompt": "3+3=", "response": " 6\n"},
    ]
    with pytest.raises(ValueError, match=r"item 1 has no field 'prompt' \(finetune.prompt_field\)") as err:
        F.load_jsonl_pairs(good)
    assert "\n" not in str(err.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no pairs"):
        F.load_jsonl_pairs(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        F.load_jsonl_pairs(bad)
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"prompt": "a", "response": "  "}\n')
    with pytest.raises(ValueError, match="empty response"):
        F.load_jsonl_pairs(blank)
    with pytest.raises(FileNotFoundError, match="finetune.paths"):
        F.load_jsonl_pairs(tmp_path / "missing.jsonl")


def test_a_dataset_with_other_field_names_is_mapped(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"question": ["a?", "b?"], "answer": [" A\n", " B\n"]}).save_to_disk(tmp_path / "ds")
    pairs = F.load_hf_pairs(str(tmp_path / "ds"), "train", "question", "answer")
    assert [(p["prompt"], p["response"]) for p in pairs] == [("a?", " A\n"), ("b?", " B\n")]
    with pytest.raises(ValueError, match=r"no column 'prompt'; columns are \['question', 'answer'\]"):
        F.load_hf_pairs(str(tmp_path / "ds"), "train")


def test_rotations_are_labelled_by_quarter_turns():
    img = np.arange(4, dtype=np.uint8).reshape(1, 2, 2, 1)  # [[0, 1], [2, 3]]
    x, y = F.rotate_images(img)
    assert y.tolist() == [0, 1, 2, 3]
    assert x[0, ..., 0].tolist() == [[0, 1], [2, 3]]
    assert x[1, ..., 0].tolist() == [[1, 3], [0, 2]]  # 90° counter-clockwise
    assert x[2, ..., 0].tolist() == [[3, 2], [1, 0]]
    with pytest.raises(ValueError, match="square"):
        F.rotate_images(np.zeros((1, 2, 3, 1), np.uint8))


def test_split_items_is_seeded_and_per_group():
    groups = ["a"] * 10 + ["b"] * 5
    tr, te = F.split_items(15, 0.2, seed=3, groups=groups)
    assert sorted(tr + te) == list(range(15)) and not set(tr) & set(te)
    assert sum(1 for i in te if groups[i] == "a") == 2 and sum(1 for i in te if groups[i] == "b") == 1
    assert F.split_items(15, 0.2, seed=3, groups=groups) == (tr, te)
    assert F.split_items(15, 0.2, seed=4, groups=groups) != (tr, te)


def test_the_batch_order_depends_on_the_seed_alone():
    from training.finetune import batch_order, order_digest

    a = batch_order(10, 4, 6, seed=1)
    assert a.shape == (6, 4)
    assert sorted(a.reshape(-1)[:10].tolist()) == list(range(10))  # the first epoch is a permutation
    assert (a == batch_order(10, 4, 6, seed=1)).all() and order_digest(a) == order_digest(batch_order(10, 4, 6, 1))
    assert order_digest(a) != order_digest(batch_order(10, 4, 6, seed=2))


def test_lora_wraps_the_named_projections_and_merges_back():
    import jax.numpy as jnp
    from flax import nnx

    from configs.model import DenseLMConfig
    from models.layers.lora import add_lora, is_adapter, merge_lora
    from models.text.dense import DecoderLM
    from training.functional import Functional, params_of

    cfg = DenseLMConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32)
    model = DecoderLM(cfg, vocab_size=64, max_len=8, rngs=nnx.Rngs(0))
    base = params_of(model)
    ids = jnp.arange(8)[None] % 64
    before = model(ids)
    paths = add_lora(model, 4, ["qkv", "down"], nnx.Rngs(1))
    assert paths == ["blocks/0/attn/qkv", "blocks/0/mlp/down", "blocks/1/attn/qkv", "blocks/1/mlp/down"]
    assert jnp.allclose(model(ids), before)  # B starts at zero: the adapted model is the base model
    _, flat = Functional.of(model)
    adapters = sorted(k for k in flat if is_adapter(k))
    assert adapters[:2] == ["blocks/0/attn/qkv/lora_a", "blocks/0/attn/qkv/lora_b"] and len(adapters) == 8
    flat = dict(flat)
    flat["blocks/0/attn/qkv/lora_b"] = jnp.ones_like(flat["blocks/0/attn/qkv/lora_b"])
    merged = merge_lora(flat)
    assert set(merged) == set(base)
    a = flat["blocks/0/attn/qkv/lora_a"]
    assert jnp.allclose(merged["blocks/0/attn/qkv/kernel"], base["blocks/0/attn/qkv/kernel"] + a @ jnp.ones((4, 48)))
    assert jnp.array_equal(merged["blocks/1/mlp/down/kernel"], base["blocks/1/mlp/down/kernel"])
    with pytest.raises(ValueError, match="match no projection"):
        add_lora(DecoderLM(cfg, 64, 8, nnx.Rngs(0)), 4, ["nothing"], nnx.Rngs(1))


@pytest.mark.slow
def test_a_lora_run_changes_only_the_adapters(small_cfg, small_data, tmp_path):
    """Fine-tune a (random-init) checkpoint with LoRA: every base weight is bit-identical afterwards,
    every adapter B moved; the saved model is base + A·B."""
    from tests.conftest import jsonl_finetune_run
    from training.common import model_spec
    from training.finetune import FinetunePlan, finetune_run
    from training.functional import params_of

    cfg, run_dir, layout, task = jsonl_finetune_run(
        small_cfg, small_data, tmp_path, mode="lora", lora_rank=2, steps=6, eval_every_steps=3
    )
    # what the checkpoint holds
    pretrained = params_of(model_spec(cfg.model, cfg.data, cfg.runtime, run_dir).init(cfg.seed))
    assert task["train_items"] == 32 and task["test_items"] == 8
    rec = finetune_run(
        FinetunePlan.of(cfg),
        run_dir,
        layout.checkpoints("pretrain", "dp"),
        layout.finetune_data,
        task,
        seed=0,
        keep_params=True,
    )
    assert rec["steps"] == 6 and rec["fresh"] == [] and len(rec["adapted"]) == 5 * cfg.model.n_layers
    assert all(k.endswith(("lora_a", "lora_b")) for k in rec["state"])
    assert rec["trainable_params"] == sum(v.size for v in rec["state"].values()) < rec["frozen_params"]
    for name, value in rec["frozen"].items():  # the frozen weights, bit for bit
        assert np.array_equal(value, np.asarray(pretrained[name.replace("/base_module", "")])), name
    assert set(rec["frozen"]) | set(rec["state"]) == {*(k for k in rec["frozen"]), *rec["state"]}
    for name, value in rec["state"].items():
        if name.endswith("lora_b"):
            assert np.abs(value).max() > 0, name  # every adapter trained
    q = "blocks/0/attn/qkv"
    expect = np.asarray(pretrained[f"{q}/kernel"]) + rec["state"][f"{q}/lora_a"] @ rec["state"][f"{q}/lora_b"]
    assert np.allclose(rec["params"][f"{q}/kernel"], expect, atol=1e-6)
    assert np.array_equal(rec["params"]["embed/embedding"], np.asarray(pretrained["embed/embedding"]))


def _complete_step(ckpt: Path, step: int = 1) -> None:
    """A checkpoint step folder as Orbax finalises it, with the items the loaders restore (params/,
    meta/; no arrays: enough for the checks that run before any work)."""
    for item in ("params", "meta"):
        (ckpt / str(step) / item).mkdir(parents=True)


def _pretrained_run(small_cfg, small_data, tmp_path, complete: bool = True):
    """A run directory with prepared data and two 'pretrained' methods (a summary and a checkpoint
    folder each: a complete step, or with ``complete=False`` an empty folder)."""
    import shutil

    from run.layout import RunLayout

    rd = tmp_path / "run"
    shutil.copytree(small_data, rd)
    layout = RunLayout(rd)
    layout.config.write_text(json.dumps(small_cfg.model_dump(mode="json")))
    for m in ("diloco", "dp"):
        layout.checkpoints("pretrain", m).mkdir(parents=True)
        if complete:
            _complete_step(layout.checkpoints("pretrain", m))
        layout.summary("pretrain", m).write_text("{}")
    return rd, layout


def _tree(rd: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(rd)): (p.read_bytes() if p.is_file() else None) for p in sorted(rd.rglob("*"))}


def _fake_run(small_cfg, small_data, tmp_path):
    """A run directory with prepared data, two 'pretrained' methods and finished fine-tuning of both
    (files only: enough for the checks that run before any work)."""
    from data.finetune import prepare_finetune_data
    from training.finetune import finetune_record

    rd, layout = _pretrained_run(small_cfg, small_data, tmp_path)
    ft_cfg = small_cfg.model_copy(update={"finetune": small_cfg.finetune.model_copy(update={"enabled": True})})
    prepare_finetune_data(
        ft_cfg.finetune, ft_cfg.finetune_task, ft_cfg.data, rd, layout.finetune_data
    )  # the task's items of that recipe
    for m in ("diloco", "dp"):
        layout.metrics("finetune", m, "train").parent.mkdir(parents=True)
        layout.metrics("finetune", m, "train").write_text("")
        layout.summary("finetune", m).write_text(
            json.dumps({"finetune_config": finetune_record(small_cfg.finetune, small_cfg.seed)})
        )
        layout.eval_result("finetune", m).parent.mkdir(parents=True, exist_ok=True)
        layout.eval_result("finetune", m).write_text(json.dumps({"method": m}))
    return rd, layout


def test_one_run_directory_compares_its_methods_under_one_recipe(small_cfg, small_data, tmp_path):
    from flows.preflight import finetune_preflight

    rd, _ = _fake_run(small_cfg, small_data, tmp_path)
    with pytest.raises(FileExistsError, match="--replace"):
        finetune_preflight(str(rd))
    plan = finetune_preflight(str(rd), ["dp"], replace=True)  # the same recipe for one method: fine
    assert plan["methods"] == {"dp": None}
    with pytest.raises(ValueError, match=r"diloco was fine-tuned with another recipe \(steps differ\)"):
        finetune_preflight(str(rd), ["dp"], overrides={"finetune.steps": 3}, replace=True)
    assert finetune_preflight(str(rd), overrides={"finetune.steps": 3}, replace=True)["methods"] == {
        "diloco": None,
        "dp": None,
    }  # every method with the new recipe


def test_a_failed_replace_restores_the_earlier_results(small_cfg, small_data, tmp_path, monkeypatch):
    import flows.finetune as FF
    from flows.preflight import finetune_preflight

    rd, layout = _fake_run(small_cfg, small_data, tmp_path)
    before = sorted(str(p.relative_to(rd)) for p in rd.rglob("*"))
    plan = finetune_preflight(str(rd), ["dp"], replace=True)

    def fail(cfg, run_dir, method, task, ckpt):  # dies after writing part of its results
        layout.metrics("finetune", method, "train").parent.mkdir(parents=True)
        layout.metrics("finetune", method, "train").write_text('{"step": 5}\n')
        raise RuntimeError("boom")

    monkeypatch.setattr(FF, "finetune_data_task", lambda cfg, run_dir: {"name": "speakers"})
    monkeypatch.setattr(FF, "finetune_task", fail)
    with pytest.raises(RuntimeError, match="boom"):
        FF.run_finetune_stage(plan)
    assert sorted(str(p.relative_to(rd)) for p in rd.rglob("*")) == before
    assert layout.metrics("finetune", "dp", "train").read_text() == ""  # the earlier file, not the new one


def test_results_left_aside_by_a_killed_replace_come_back_or_are_named(small_cfg, small_data, tmp_path):
    """A --replace killed with SIGKILL leaves its earlier results in hidden ``.X.replaced-<tag>``
    folders. The next fine-tuning start moves one back whose place is empty and, where newer results
    stand, keeps both and says which is which."""
    import flows.finetune as FF

    rd, layout = _fake_run(small_cfg, small_data, tmp_path)
    dp_dir, dp_eval = layout.method_dir("finetune", "dp"), layout.eval_result("finetune", "dp")
    dp_dir.rename(dp_dir.with_name(".dp.replaced-0123abcd"))  # killed right after putting it aside
    dp_eval.rename(dp_eval.with_name(f".{dp_eval.name}.replaced-0123abcd"))
    dl = layout.method_dir("finetune", "diloco")
    (dl.parent / ".diloco.replaced-89abcdef").mkdir()  # killed after the new results were started
    lines = FF._recover_aside(layout)  # (each also logged as a warning)
    assert dp_dir.is_dir() and json.loads(dp_eval.read_text()) == {"method": "dp"}
    assert layout.metrics("finetune", "dp", "train").read_text() == ""
    assert len(lines) == 3 and sum("moved back" in line for line in lines) == 2
    assert (dl.parent / ".diloco.replaced-89abcdef").is_dir() and dl.is_dir()
    assert any("Delete .diloco.replaced-89abcdef to keep the newer" in line for line in lines)
    # the task data put aside with them: back with the results it made (the newer data/ goes)
    (layout.finetune_data / "manifest.json").write_text('{"old": true}')
    shutil_copy = __import__("shutil").copytree
    shutil_copy(layout.finetune_data, layout.finetune_data.with_name(".data.replaced-0123abcd"))
    (layout.finetune_data / "manifest.json").write_text('{"new": true}')
    dp_dir.rename(dp_dir.with_name(".dp.replaced-0123abcd"))
    FF._recover_aside(layout)
    assert json.loads((layout.finetune_data / "manifest.json").read_text()) == {"old": True} and dp_dir.is_dir()
    # a replace killed while cleaning up (its results written, no result left aside): the data copy goes
    __import__("shutil").rmtree(dl.parent / ".diloco.replaced-89abcdef")
    shutil_copy(layout.finetune_data, layout.finetune_data.with_name(".data.replaced-feedbeef"))
    FF._recover_aside(layout)
    assert sorted(p.name for p in layout.finetune_data.parent.iterdir() if p.name.startswith(".")) == []


def test_a_failed_replace_with_another_recipe_restores_the_task_data(small_cfg, small_data, tmp_path, monkeypatch):
    """--replace with a new recipe rebuilds finetune/data/ (its items depend on the recipe); when the
    stage then fails, the earlier results come back with the data they were made from."""
    import flows.finetune as FF
    from data.finetune import prepare_finetune_data
    from flows.preflight import finetune_preflight

    rd, layout = _fake_run(small_cfg, small_data, tmp_path)
    before = _tree(rd)
    plan = finetune_preflight(str(rd), overrides={"finetune.max_test_items": 7}, replace=True)
    seen = {}

    def data_task(cfg, run_dir):  # the real data step (the task without Prefect's wrapper)
        out = prepare_finetune_data(cfg.finetune, cfg.finetune_task, cfg.data, run_dir, layout.finetune_data)
        seen["manifest"] = json.loads((layout.finetune_data / "manifest.json").read_text())
        return out

    def fail(cfg, run_dir, method, task, ckpt):
        raise RuntimeError("boom")

    monkeypatch.setattr(FF, "finetune_data_task", data_task)
    monkeypatch.setattr(FF, "finetune_task", fail)
    with pytest.raises(RuntimeError, match="boom"):
        FF.run_finetune_stage(plan)
    assert seen["manifest"]["config"]["finetune"]["max_test_items"] == 7  # the new recipe's data was swapped in
    assert _tree(rd) == before  # and the old data is back, byte for byte, with nothing left aside
    # once the stage succeeds, nothing is kept aside
    monkeypatch.setattr(FF, "finetune_task", lambda cfg, run_dir, method, task, ckpt: {"runs": []})
    monkeypatch.setattr(FF, "evaluate_finetune_task", lambda cfg, run_dir, method, task, ckpt: {})
    FF.run_finetune_stage(plan)
    assert sorted(p.name for p in (rd / "finetune").iterdir()) == ["data"]
    assert json.loads((layout.finetune_data / "manifest.json").read_text())["config"]["finetune"]["max_test_items"] == 7


def test_a_checkpoint_is_never_named_after_another_pretrained_method(small_cfg, small_data, tmp_path):
    """--name diloco on DP's checkpoint would put DP's fine-tuned figures under DiLoCo in the report."""
    import shutil

    from flows.preflight import finetune_preflight
    from tests.test_refusals import cli, one_line_refusal

    rd, layout = _pretrained_run(small_cfg, small_data, tmp_path)
    dp, diloco = layout.checkpoints("pretrain", "dp"), layout.checkpoints("pretrain", "diloco")
    before = _tree(rd)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"--name diloco is this run's pretrained method (its checkpoint is {diloco}); pick another name"
        ),
    ):
        finetune_preflight(None, checkpoint=str(dp), name="diloco")
    line = one_line_refusal(*cli("finetune", "--checkpoint", dp, "--name", "diloco"))
    assert "--name diloco is this run's pretrained method" in line
    assert _tree(rd) == before  # nothing written
    # a method's own checkpoint under its own name, or a new name, is fine
    assert finetune_preflight(None, checkpoint=str(dp), name="dp")["methods"] == {"dp": str(dp)}
    assert finetune_preflight(None, checkpoint=str(dp), name="dp-again")["methods"] == {"dp-again": str(dp)}
    # a method name the pipeline uses is taken even where this run did not pretrain it
    shutil.rmtree(diloco.parent)
    with pytest.raises(ValueError, match="--name diloco is a pretraining method's name"):
        finetune_preflight(None, checkpoint=str(dp), name="diloco")


def test_checkpoint_folders_without_a_complete_step_are_refused(small_cfg, small_data, tmp_path):
    """Empty checkpoint folders, or only partial steps (an interrupted save's temporary folder, a step
    without its items), are refused before any work, naming the method; not after minutes of it."""
    from flows.preflight import finetune_preflight
    from tests.test_refusals import cli, one_line_refusal

    rd, layout = _pretrained_run(small_cfg, small_data, tmp_path, complete=False)
    dp = layout.checkpoints("pretrain", "dp")
    before = _tree(rd)
    with pytest.raises(FileNotFoundError, match=r"diloco .*holds no complete checkpoint step.*re-run pretraining"):
        finetune_preflight(str(rd))
    (dp / "2.orbax-checkpoint-tmp-1234" / "params").mkdir(parents=True)  # interrupted saves
    (dp / "1").mkdir()
    (dp / "3" / "meta").mkdir(parents=True)
    from training.ckpt_steps import complete_steps

    assert complete_steps(dp) == []
    before = _tree(rd)
    with pytest.raises(FileNotFoundError, match=r"dp .*holds no complete checkpoint step.*re-run pretraining"):
        finetune_preflight(str(rd), ["dp"])
    with pytest.raises(FileNotFoundError, match=r"--checkpoint .* holds no complete checkpoint step"):
        finetune_preflight(None, checkpoint=str(dp), name="mine")
    line = one_line_refusal(*cli("finetune", rd, "--methods", "dp"))
    assert "re-run pretraining" in line and " dp " in line
    assert _tree(rd) == before  # nothing written
    _complete_step(dp, 4)
    assert complete_steps(dp) == [4]
    assert finetune_preflight(str(rd), ["dp"])["methods"] == {"dp": None}
    assert finetune_preflight(None, checkpoint=str(dp), name="mine")["methods"] == {"mine": str(dp)}


def test_the_checkpoint_completeness_test_needs_no_jax():
    import subprocess
    import sys

    code = "import sys, training.ckpt_steps; assert 'jax' not in sys.modules and 'orbax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# -- issue 25, new-user round: pair files as users have them -------------------------------------
def _pairs_file(path, rows, encoding="utf-8", bom=False):
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode(encoding))
    return path


def test_a_pairs_file_that_is_not_utf8_is_refused_naming_file_and_offset(tmp_path):
    """A Latin-1 file is refused in one line naming finetune.paths, the file, the byte and its offset
    (the old code raised the codec's bare "'utf-8' codec can't decode byte 0xe9 in position 23"); a
    UTF-8 file with a byte-order mark is read."""
    rows = [{"prompt": "caf\u00e9?", "response": " yes\n"}]
    latin = _pairs_file(tmp_path / "latin.jsonl", rows, encoding="latin-1")
    offset = latin.read_bytes().index(b"\xe9")
    with pytest.raises(ValueError) as err:
        F.load_jsonl_pairs(latin)
    assert str(err.value) == (
        f"finetune.paths: {latin} is not valid UTF-8 (byte 0xe9 at offset {offset}): re-save it as UTF-8"
    )
    bom = _pairs_file(tmp_path / "bom.jsonl", rows, bom=True)
    assert F.load_jsonl_pairs(bom) == [{"id": "0", "prompt": "caf\u00e9?", "response": " yes\n"}]


def test_repeated_pair_ids_are_refused_naming_both_lines(tmp_path):
    """Ids must be unique (compared as text: 1 and "1" are one id), within a file and across a train and
    a test file; the old code let them through to crash evaluation after training."""
    rows = [{"id": "same", "prompt": f"q{i}", "response": f" a{i}\n"} for i in range(3)]
    same = _pairs_file(tmp_path / "same.jsonl", rows)
    with pytest.raises(
        ValueError,
        match=rf"^{same}: line 2 repeats the id 'same' of line 1; make ids unique "
        r"or drop the id field$",
    ):
        F.load_jsonl_pairs(same)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"id": 1, "prompt": "a", "response": "b"}\n\n{"id": "1", "prompt": "c", "response": "d"}\n')
    with pytest.raises(ValueError, match=r"line 3 repeats the id '1' of line 1"):
        F.load_jsonl_pairs(mixed)
    train = _pairs_file(
        tmp_path / "train.jsonl", [{"id": f"t{i}", "prompt": f"q{i}", "response": " a\n"} for i in range(10)]
    )
    test = _pairs_file(
        tmp_path / "test.jsonl", [{"id": f"t{9 - i}", "prompt": f"p{i}", "response": " b\n"} for i in range(5)]
    )
    with pytest.raises(
        ValueError,
        match=rf"^finetune.paths: {test} line 1 repeats the id 't9' of {train} line 10; "
        r"make ids unique or drop the id field$",
    ):
        F.load_jsonl_pair_files([train, test])
    from pathlib import Path

    from configs.load import load_config
    from flows.preflight import check_finetune_inputs

    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    cfg = load_config(tiny, {"finetune.source": "jsonl", "finetune.paths": [str(train), str(test)]})
    with pytest.raises(ValueError, match="repeats the id 't9'"):
        check_finetune_inputs(cfg.finetune, cfg.finetune_task, cfg.data.seed)
    plain = [
        _pairs_file(tmp_path / f"{n}.jsonl", [{"prompt": f"q{i}", "response": " a\n"} for i in range(k)])
        for n, k in (("tr", 10), ("te", 5))
    ]
    assert [len(p) for p in F.load_jsonl_pair_files(plain)] == [10, 5]  # ids by position may repeat across files
