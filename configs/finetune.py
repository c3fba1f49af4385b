"""The ``finetune`` section: the post-training stage (task, budget, optimizer, seeds)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from configs.base import _Strict
from configs.methods import InnerOptConfig


class FinetuneConfig(_Strict):
    """Post-training: one recipe applied identically to every pretrained model (same data, order,
    seeds, steps and optimizer), then evaluated before and after.

    ``source``: the fine-tuning task. Text: ``speakers`` (the embedded default: name the character
    who speaks a line of a play held out of pretraining, ``data.finetune_docs``), ``jsonl``
    (``paths``: a train file and optionally a test file of ``prompt``/``response`` lines) or ``hf``
    (``hf_name``, fields mapped by ``prompt_field``/``response_field``; needs the hub). Images:
    ``rotation`` (the embedded default: which of 0/90/180/270° a held-out image was turned by, a
    new 4-way head on the pretrained backbone). Unset = the modality's embedded task.
    """

    enabled: bool = Field(False, description="fine-tune and evaluate the pretrained models after pretraining")
    source: Literal["speakers", "jsonl", "hf", "rotation"] | None = Field(
        None,
        description="the task: speakers (text default), jsonl (finetune.paths), hf (finetune.hf_name) "
        "or rotation (images default); unset = the data's embedded task",
    )
    paths: list[str] = Field(default_factory=list, description="jsonl: [train.jsonl] or [train.jsonl, test.jsonl]")
    hf_name: str | None = Field(None, description="hf: a Hugging Face dataset name or local dataset folder")
    hf_split: str = Field("train", description="hf: the split to fine-tune on")
    hf_test_split: str | None = Field(
        None, description="hf: a split to test on; unset = cut test_fraction off the train split"
    )
    prompt_field: str = Field("prompt", description="jsonl/hf: the field holding the prompt")
    response_field: str = Field("response", description="jsonl/hf: the field holding the response")
    test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="share of the pairs (or items) held out as the task's test set"
    )
    max_test_items: PositiveInt | None = Field(
        600, description="evaluate at most this many test items (a seeded sample); unset = all"
    )
    speaker_context: int = Field(
        2, ge=0, description="speakers: speeches before the one to attribute shown in the prompt, each with its speaker"
    )
    speaker_lines: PositiveInt = Field(2, description="speakers: lines of the speech to attribute")
    mode: Literal["full", "lora"] = Field(
        "full",
        description="full: every parameter trains; lora: low-rank adapters "
        "(Flax NNX LoRA) on finetune.lora_targets, the rest frozen",
    )
    lora_rank: PositiveInt = Field(8, description="lora: rank r of each adapter")
    lora_alpha: PositiveFloat | None = Field(
        None,
        description="lora: α of each adapter; the adapter's product B·A enters scaled by α/r, in training "
        "and in the merged checkpoint (Hu et al. 2021, §4.1); unset = the rank (scale 1)",
    )
    lora_targets: list[Literal["qkv", "out", "gate", "up", "down", "router", "patch"]] = Field(
        default_factory=lambda: ["qkv", "out", "gate", "up", "down"],
        description="lora: projections that get adapters (attention qkv/out, MLP gate/up/down, MoE router, ViT patch)",
    )
    steps: PositiveInt = Field(200, description="optimizer steps per fine-tuning run")
    batch_size: PositiveInt = Field(16, description="examples (rows) per step")
    optimizer: InnerOptConfig = Field(
        default_factory=lambda: InnerOptConfig(lr=1e-3, warmup_steps=10, weight_decay=0.0),
        description="the fine-tuning optimizer (AdamW, warmup, cosine decay)",
    )
    seeds: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(
        default_factory=lambda: [0],
        min_length=1,
        description="one fine-tuning run per seed and method (data order, "
        "adapter/new-head initialisation); more seeds narrow the report's interval",
    )
    packing: bool = Field(
        False,
        description="text: pack several pairs into one row (loss mask carried through) "
        "instead of one padded pair per row",
    )
    seq_len: PositiveInt | None = Field(
        None, description="text: tokens per row; unset = the longest pair, rounded up to 16, at most data.seq_len"
    )
    eval_every_steps: PositiveInt = Field(25, description="loss on the task's test items every this many steps")
    max_gen_toks: PositiveInt | None = Field(
        None,
        description="text: greedy generation cap for the exact-match task, tokens; unset = the longest "
        "response of the task + 2 (a cap below a response's length makes it unmatchable)",
    )

    @model_validator(mode="after")
    def _check(self) -> FinetuneConfig:
        if self.source == "jsonl" and not 1 <= len(self.paths) <= 2:
            raise ValueError(
                "finetune.paths must hold a train .jsonl file, and optionally a test one, for finetune.source: jsonl"
            )
        if self.source == "hf" and not self.hf_name:
            raise ValueError("finetune.hf_name must be set when finetune.source is 'hf'")
        if self.source not in ("jsonl",) and self.paths:
            raise ValueError("finetune.paths applies to finetune.source: jsonl; remove it")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"finetune.seeds {self.seeds} repeats a seed; list each once")
        if len(set(self.lora_targets)) != len(self.lora_targets) or not self.lora_targets:
            raise ValueError("finetune.lora_targets must name at least one projection, each once")
        return self
