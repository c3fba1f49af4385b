"""The terminal: ddiloco run's progress bars (flows/terminal.py, fed by run/progress.py) and the
one-line evaluation summary (tasks/evaluate.py)."""

import io

from rich.console import Console

from flows.terminal import progress_display
from run.progress import Progress, report, subscribe
from tasks.evaluate import metrics_line


def test_each_method_gets_a_bar_with_its_tokens_speed_losses_and_learners():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    with progress_display(enabled=True, console=console):
        report(Progress("diloco", 12_288, 24_576, "tokens", train_loss=5.4, heldout_loss=5.5, learners=(3, 4)))
        report(Progress("diloco", 24_576, 24_576, "tokens", train_loss=5.3, heldout_loss=5.35, learners=(0, 4)))
        report(Progress("dp", 24_576, 24_576, "tokens", train_loss=5.1, heldout_loss=5.15))
    text = out.getvalue()
    assert "DiLoCo" in text and "DP" in text
    assert "24,576/24,576 tokens" in text and "learners up 0/4" in text and "held-out 5.150" in text
    report(Progress("dp", 1, 2))  # closed: nobody listens, nothing breaks


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
