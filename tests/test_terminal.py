"""The terminal: ddiloco run's progress bars (flows/terminal.py, fed by run/progress.py) and the
one-line evaluation summary (tasks/evaluate.py)."""

import io
import re

from rich.console import Console

from flows.terminal import progress_display
from run.progress import Progress, report, subscribe
from tasks.evaluate import metrics_line


def _draw(width: int) -> str:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=width, color_system=None)
    with progress_display(enabled=True, console=console):
        report(Progress("diloco", 1_000_000, 2_002_944, "tokens", train_loss=5.4, heldout_loss=5.5, learners=(3, 4)))
        report(Progress("diloco", 2_002_944, 2_002_944, "tokens", train_loss=5.3, heldout_loss=5.35, learners=(0, 4)))
        report(Progress("dp", 2_002_944, 2_002_944, "tokens", train_loss=5.1, heldout_loss=5.15))
    return out.getvalue()


def test_each_method_gets_a_bar_with_its_tokens_speed_losses_and_learners():
    text = _draw(160)
    assert "DiLoCo" in text and "DP" in text
    assert "2.00M/2.00M tokens" in text and "train 5.300" in text and "held-out 5.150" in text
    assert "learners done" in text and "up 0/4" not in text  # all learners finished
    report(Progress("dp", 1, 2))  # closed: nobody listens, nothing breaks


def test_the_bars_fit_an_80_column_terminal():
    """At 80 columns (a terminal's default, and what ``script`` or a pipe-to-terminal gets) every
    field stays whole: no cut with an ellipsis, the held-out loss and learners still shown."""
    text = _draw(80)
    lines = [ln for ln in re.split(r"\x1b\[[0-9;]*[A-Za-z]|\r|\n", text) if "DiLoCo" in ln or "DP" in ln]
    assert lines and all(len(ln.rstrip()) <= 80 for ln in lines), lines
    assert "…" not in text and "2.00M/2.00M tokens" in text and "held-out 5.350" in text and "up 0/4" in text


def test_a_failing_display_never_reaches_the_training():
    def broken(p):
        raise RuntimeError("display gone")

    unsubscribe = subscribe(broken)
    try:
        report(Progress("dp", 1, 2))
    finally:
        unsubscribe()


def test_an_evaluation_is_one_line():
    m = {
        "checkpoint_tokens": 24576,
        "heldout_ppl/word_perplexity": 4079452.6,
        "heldout_ppl/word_perplexity_stderr": 2342485.3,
        "heldout_ppl/bits_per_byte": 3.9617,
        "heldout_ppl/bits_per_byte_stderr": 0.0619,
        "heldout_nextline/acc": 0.25,
        "heldout_nextline/acc_stderr": 0.1637,
        "heldout_nextline/chance": 0.25,
        "heldout_nextline/questions": 8,
        "truncated_requests": 32,
        "eval_s": 3.5,
    }
    assert metrics_line(m) == (
        "heldout_ppl/bits_per_byte 3.962 ± 0.0619, heldout_nextline/acc 0.25 ± 0.1637 (chance 0.25); 3.5 s"
    )
