"""The ``eval`` section: the evaluation stage after pretraining and fine-tuning."""

from __future__ import annotations

from pydantic import (
    Field,
    PositiveInt,
)

from configs.base import _Strict


class EvalConfig(_Strict):
    """lm-eval-harness on tasks generated from the held-out test plays."""

    enabled: bool = Field(True, description="run lm-eval on the held-out plays after pretraining")
    ppl_docs: PositiveInt = Field(16, description="test passages for perplexity")
    ppl_chars: PositiveInt = Field(2000, description="characters per perplexity passage")
    mc_questions: PositiveInt = Field(200, description="which-line-comes-next questions")
    mc_context_lines: PositiveInt = Field(4, description="lines of context before the answer")
    batch_size: PositiveInt = Field(32, description="sequences per lm-eval forward pass")
    verbose: bool = Field(
        False,
        description="show lm-eval's own INFO lines and progress bars in the run's log (off: its warnings only; "
        "each evaluation is one summary line)",
    )
