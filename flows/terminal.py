"""``ddiloco run``'s progress display in a terminal: one rich progress bar per pretraining method,
showing units trained of the budget, units per second, time left, the latest training and held-out
loss and DiLoCo's learners up (below 120 columns a shorter bar without the training loss, so that a
line fits 80 columns). The bars share Prefect's console (its log lines print above them); they are
drawn only when stderr is a terminal, so a piped or logged run is plain lines.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from run.progress import Progress, subscribe

NAMES = {"diloco": "DiLoCo", "dp": "DP"}
WIDE = 120  # columns from which the bars show every figure at full length


def compact(x: float) -> str:
    """``1,234`` → ``1,234``; ``12,345`` → ``12.3k``; ``2,002,944`` → ``2.00M`` (units or units/s)."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e4, "k")):
        if abs(x) >= scale:
            return f"{x / (scale if suffix != 'k' else 1e3):.{2 if suffix != 'k' else 1}f}{suffix}"
    return f"{x:,.0f}"


def _prefect_console():
    """The rich Console of Prefect's console log handler, if one is installed."""
    for logger in (logging.getLogger("prefect"), logging.getLogger()):
        for h in logger.handlers:
            console = getattr(h, "console", None)
            if console is not None:
                return console
    return None


@contextlib.contextmanager
def progress_display(enabled: bool | None = None, console=None) -> Iterator[None]:
    """While open, draw every :func:`run.progress.report` as a bar (``enabled``: default, when
    stderr is a terminal) on ``console`` (default: Prefect's, else a rich console on stderr)."""
    if not (sys.stderr.isatty() if enabled is None else enabled):
        yield
        return
    from rich.console import Console
    from rich.default_styles import DEFAULT_STYLES
    from rich.progress import BarColumn, Progress as Bars, TextColumn, TimeRemainingColumn
    from rich.theme import Theme

    console = console or _prefect_console()
    if console is None:
        console = Console(stderr=True)
    else:  # Prefect's console theme has no styles for bars: add rich's own (bar.*, progress.*)
        console.push_theme(Theme({k: v for k, v in DEFAULT_STYLES.items() if k.startswith(("bar.", "progress."))}))

    wide = console.width >= WIDE  # an 80-column terminal gets a shorter bar and fewer figures
    bars = Bars(
        TextColumn("[bold]{task.description:>6}"),
        BarColumn(bar_width=24 if wide else 12),
        TextColumn("{task.fields[count]}"),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(compact=True, elapsed_when_finished=True),
        TextColumn("{task.fields[figures]}"),
        console=console,
        refresh_per_second=2,
    )
    ids: dict[str, int] = {}

    def show(p: Progress) -> None:
        figures = []
        if p.train_loss is not None and wide:
            figures.append(f"train {p.train_loss:.3f}")
        if p.heldout_loss is not None:
            figures.append(f"held-out {p.heldout_loss:.3f}")
        if p.learners is not None:
            up, of = p.learners
            finished = p.done >= p.total and up == 0
            figures.append(f"learners {'done' if finished else f'up {up}/{of}'}" if wide else f"up {up}/{of}")
        if p.method not in ids:
            ids[p.method] = bars.add_task(NAMES.get(p.method, p.method), total=p.total, count="", rate="", figures="")
        task = ids[p.method]
        count = f"{compact(p.done)}/{compact(p.total)} {p.unit}"
        bars.update(task, completed=p.done, total=p.total, count=count, figures="  ".join(figures))
        speed = next(t.speed for t in bars.tasks if t.id == task)
        bars.update(task, rate=f"{compact(speed)} {p.unit}/s" if speed else "")

    unsubscribe = subscribe(show)
    bars.start()
    try:
        yield
    finally:
        unsubscribe()
        bars.stop()
