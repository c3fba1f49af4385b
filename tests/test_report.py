"""The run report, on a small synthetic run directory whose numbers can be checked by hand.

The run: 2 learners, 2 fragments, 32,768 tokens per method. Learner 1's scheduled (chaos) failure
at local step 40 fires at t = 8 s (attempt 1; the exchange's last completed step is 39), a retry is
scheduled at t = 9 s and attempt 2 starts at t = 12 s, so it is down for 4 s.
Merges (seconds since training start, fragment, contributors):
    2.0 f0 [0,1] | 4.0 f1 [0,1] | 6.0 f0 [0,1]          before the failure
    8.5 f1 [0]   | 10.0 f0 [0]  | 11.5 f1 [0,1 (stale)]  while learner 1 is down → 3 merges,
                                                         1 of them carrying its earlier submission
    14.0 f0 [0,1] | 16.0 f1 [0,1]                        after the restart: merged again, first 14.0
Final held-out losses: DiLoCo 3.30, DP 3.00 nats → gap = 100 × (3.30 − 3.00) / 3.00 = +10.00 %.
Token ledger (P = 2): learner 1 processed 14,336 = submitted 12,288 + not submitted 2,048, and
submitted 12,288 = merged 10,240 + dropped 1,024 + pending 1,024.
Bytes (4,096 bytes per fragment): 16 submissions sent (14 merged, 1 dropped, 1 pending) = 65,536
bytes to the syncer; 20 fragment pulls = 81,920 bytes from it; the merge log's bytes_in = 14 × 4,096
and bytes_out = 8 × 4,096 × 2. DP: 123,456 float32 parameters = 493,824 gradient bytes; a ring
all-reduce over M = 2 workers sends 2(M−1)/M × 493,824 per worker per step and receives as many, so
64 steps make 31,604,736 sent per worker, 63,209,472 sent by both, as many received, and
126,418,944 all-reduce bytes (sent + received).
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import matplotlib.image
import pytest
from PIL import Image

from reports import ReportInputError, build_report
from reports.artifacts import artifact_key, publish_report_artifacts
from reports.common import NOT_RUN
from reports.learners import learner_failures
from reports.plots import loss_figure
from reports.read import read_jsonl
from run.layout import RunLayout
from tests.conftest import squash

PRE = "pretrain"


def _layout(run: Path) -> RunLayout:
    return RunLayout(run)


def _stage(report: dict, stage: str = PRE) -> dict:
    return report["stages"][stage]


def _method(report: dict, method: str = "diloco", stage: str = PRE) -> dict:
    return report["stages"][stage]["methods"][method]


def _write(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


INNER = {"name": "adamw", "lr": 0.003, "warmup_steps": 4, "weight_decay": 0.1}
MERGES = [  # (merged_at_s, fragment, contributors, stale)
    (2.0, 0, [0, 1], [False, False]),
    (4.0, 1, [0, 1], [False, False]),
    (6.0, 0, [0, 1], [False, False]),
    (8.5, 1, [0], [False]),
    (10.0, 0, [0], [False]),
    (11.5, 1, [0, 1], [False, True]),
    (14.0, 0, [0, 1], [False, False]),
    (16.0, 1, [0, 1], [False, False]),
]


def _make_run(root: Path) -> Path:
    run = root / "tiny-20261129-101500"
    lay = _layout(run)
    _write(
        lay.config,
        {
            "name": "tiny",
            "seed": 0,
            "data": {"source": "shakespeare", "seq_len": 64, "vocab_size": 512},
            "model": {"kind": "dense_lm", "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 96},
            "diloco": {
                "learners": 2,
                "fragments": 2,
                "sync_every": 8,
                "quorum": 1,
                "grace_s": 0.5,
                "merge": "token_weighted",
                "batch_size": 4,
                "inner": INNER,
            },
            "dp": {"enabled": True, "inner": INNER},
            "train": {"token_budget": 32768},
            "chaos": {"failures": [{"learner": 1, "at_step": 40}]},
            "eval": {"enabled": True},
        },
    )
    _write(
        lay.manifest,
        {
            "source": "shakespeare",
            "sha256": "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
            "vocab_size": 512,
            "seq_len": 64,
            "documents": {
                "train": [f"play {i}" for i in range(39)],
                "val": ["hamlet", "macbeth"],
                "test": ["othello", "king lear"],
            },
            "tokens": {"train": 1_200_000, "val": 60_000, "test": 58_000},
            "shards": {"shard_00": 600_000, "shard_01": 600_000},
        },
    )
    toks = [0, 8192, 16384, 24576, 32768]
    _write_jsonl(
        lay.metrics(PRE, "diloco", "eval"),
        [
            {"method": "diloco", "tokens": t, "wall_s": 5.0 * i, "step": 32 * i, "val/loss": loss}
            for i, (t, loss) in enumerate(zip(toks, [6.20, 4.10, 3.60, 3.40, 3.30]))
        ],
    )
    _write_jsonl(
        lay.metrics(PRE, "dp", "eval"),
        [
            {"method": "dp", "tokens": t, "wall_s": 7.0 * i, "step": 16 * i, "val/loss": loss}
            for i, (t, loss) in enumerate(zip(toks, [6.20, 3.90, 3.40, 3.25, 3.00]))
        ],
    )
    _write_jsonl(
        lay.metrics(PRE, "diloco", "merges"),
        [
            {
                "fragment": f,
                "version": v + 1,
                "contributors": c,
                "weights": [1 / len(c)] * len(c),
                "tokens": [2048] * len(c),
                "steps": [8] * len(c),
                "quorum_at_s": t - 0.5,
                "merged_at_s": t,
                "grace_s": 0.5,
                "stale": s,
                "bytes_in": 4096 * len(c),
                "fragment_bytes": 4096,
                "bytes_out": 4096 * 2,
            }  # fragment bytes × M learners
            for v, (t, f, c, s) in enumerate(MERGES)
        ],
    )
    _write_jsonl(
        lay.metrics(PRE, "diloco", "learners"),
        [
            {"event": "start", "learner": 0, "attempt": 1, "t": 0.0, "step": 0},
            {"event": "start", "learner": 1, "attempt": 1, "t": 0.1, "step": 0},
            {"event": "step", "learner": 1, "step": 30, "train/loss": 4.0, "tokens": 7680, "t": 7.9},
            {
                "event": "failure",
                "learner": 1,
                "attempt": 1,
                "t": 8.0,
                "step": 39,
                "reason": "InjectedFailure('learner 1: injected failure at local step 40')",
            },
            {"event": "retry", "learner": 1, "attempt": 1, "t": 9.0, "step": 39, "reason": "prefect retry"},
            {"event": "start", "learner": 1, "attempt": 2, "t": 12.0, "step": 39},
            {"event": "stop", "learner": 0, "attempt": 1, "t": 20.0, "step": 144, "reason": "budget"},
            {"event": "stop", "learner": 1, "attempt": 2, "t": 20.0, "step": 112, "reason": "budget"},
            *(
                {"event": "state", "state": s, "learner": m, "attempt": a, "t": t}
                for m, s, a, t in [(0, "up", 1, 0.0), (1, "up", 1, 0.1), (1, "down", 1, 8.0), (1, "restarting", 2, 9.0)]
                + [(1, "up", 2, 12.0), (0, "done", 1, 20.0), (1, "done", 2, 20.0)]
            ),
            # The syncer appends its own events (a dropped submission) at the end of the run.
            {
                "event": "dropped",
                "learner": 1,
                "fragment": 0,
                "reason": "stale",
                "tokens": 1024,
                "base_version": 2,
                "t": 13.0,
                "source": "syncer",
            },
        ],
    )
    _write(
        lay.summary(PRE, "diloco"),
        {
            "method": "diloco",
            "hyperparameters": {
                "inner": INNER,
                "outer_lr": 0.7,
                "outer_momentum": 0.9,
                "sync_every": 8,
                "fragments (P)": 2,
                "learners (M)": 2,
                "batch_size": 4,
            },
            "tokens": 32768,
            "steps": 256,
            "wall_s": 20.0,
            "tokens_per_s": 1638.4,
            "final_val_loss": 3.30,
            "merges": 8,
            "bytes_to_syncer": 16 * 4096,
            "bytes_merged": 14 * 4096,
            "bytes_from_syncer": 20 * 4096,
            "fragment_bytes": [4096, 4096],
            # Integer token counts, drop reasons and attempts (processed = submitted + not_submitted,
            # submitted = merged + dropped + pending).
            "ledger": {
                "0": {
                    "processed": 18432,
                    "submitted": 18432,
                    "not_submitted": 0,
                    "merged": 18432,
                    "dropped": 0,
                    "pending": 0,
                    "drop_reasons": {},
                    "attempts": 1,
                },
                "1": {
                    "processed": 14336,
                    "submitted": 12288,
                    "not_submitted": 2048,
                    "merged": 10240,
                    "dropped": 1024,
                    "pending": 1024,
                    "drop_reasons": {"stale": 1024},
                    "attempts": 2,
                },
            },
            "params": 123456,
            "flops_per_token": 812345.0,
        },
    )
    _write(
        lay.summary(PRE, "dp"),
        {
            "method": "dp",
            "hyperparameters": {"inner": INNER, "batch_size": 8, "simulated workers": 2},
            "tokens": 32768,
            "steps": 64,
            "wall_s": 28.0,
            "tokens_per_s": 1170.2857,
            "final_val_loss": 3.00,
            "merges": None,
            "bytes_to_syncer": 63_209_472,
            "bytes_from_syncer": 63_209_472,
            "allreduce_bytes": 126_418_944,
            "params": 123456,
            "flops_per_token": 812345.0,
        },
    )
    _write(
        lay.eval_result(PRE, "diloco"),
        {
            "method": "diloco",
            "checkpoint_tokens": 32768,
            "heldout_ppl/word_perplexity": 85.25,
            "heldout_ppl/word_perplexity_stderr": 1.5,
            "heldout_ppl/byte_perplexity": 2.6103,
            "heldout_ppl/bits_per_byte": 1.3842,
            "heldout_ppl/passages": 40,
            "heldout_nextline/acc": 0.31,
            "heldout_nextline/acc_stderr": 0.035,
            "heldout_nextline/acc_norm": 0.335,
            "heldout_nextline/acc_norm_stderr": 0.036,
            "heldout_nextline/chance": 0.25,
            "heldout_nextline/questions": 200,
            "truncated_requests": 3,
            "eval_s": 12.5,
        },
    )
    _write(
        lay.eval_result(PRE, "dp"),
        {
            "method": "dp",
            "checkpoint_tokens": 32768,
            "heldout_ppl/word_perplexity": 70.5,
            "heldout_ppl/word_perplexity_stderr": 1.25,
            "heldout_ppl/byte_perplexity": 2.5012,
            "heldout_ppl/bits_per_byte": 1.3227,
            "heldout_ppl/passages": 40,
            "heldout_nextline/acc": 0.345,
            "heldout_nextline/acc_stderr": 0.0336,
            "heldout_nextline/acc_norm": 0.36,
            "heldout_nextline/acc_norm_stderr": 0.034,
            "heldout_nextline/chance": 0.25,
            "heldout_nextline/questions": 200,
            "truncated_requests": 0,
            "eval_s": 11.0,
        },
    )
    return run


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A fresh synthetic run for tests that change files."""
    return _make_run(tmp_path)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """One report built once for the read-only tests (plotting costs about a second a build)."""
    run = _make_run(tmp_path_factory.mktemp("built"))
    report = build_report(run)
    return run, report, squash(_layout(run).report_md.read_text())


def _row(report: dict, key: str, stage: str = PRE) -> dict:
    return next(r for r in _stage(report, stage)["comparison"] if r["key"] == key)


def test_table_has_the_right_numbers(built):
    run_dir, report, md = built
    assert report["run"]["name"] == "tiny"
    assert _row(report, "tokens")["diloco"] == 32768 and _row(report, "tokens")["dp"] == 32768
    assert _row(report, "steps")["diloco"] == 256 and _row(report, "steps")["dp"] == 64
    assert _row(report, "final_val_loss")["dp"] == 3.0
    assert _row(report, "final_val_ppl")["diloco"] == pytest.approx(math.exp(3.3))  # 27.1126
    assert _row(report, "merges")["diloco"] == 8 and _row(report, "merges")["dp"] is None
    # DP's ring all-reduce: half of allreduce_bytes sent, half received (all workers).
    assert _row(report, "bytes_sent")["dp"] == 63_209_472 == _row(report, "bytes_received")["dp"]
    assert _row(report, "bytes_total")["dp"] == 126_418_944
    assert _row(report, "heldout_nextline/acc")["dp"] == 0.345
    assert "| training tokens (tokens) | 32,768 | 32,768 |" in md
    assert "| optimizer steps (DiLoCo: inner steps summed over learners) (steps) | 256 | 64 |" in md
    assert "| final held-out loss (the curves' validation sample) (nats/token) | 3.3000 | 3.0000 |" in md
    assert "| final held-out perplexity exp(loss) | 27.113 | 20.086 |" in md
    assert "| heldout_ppl: word perplexity | 85.250 ± 1.500 | 70.500 ± 1.250 |" in md
    assert "| merges (DiLoCo) (merges) | 8 | — |" in md
    # Header: versions and a git commit (or "unknown" where there is no commit yet).
    assert "- git commit: `" in md and "prefect 3.9.1" in md and "lm_eval" in md
    # Hyperparameters side by side (nested dicts flattened with slashes).
    assert "| inner/lr | 0.003 | 0.003 |" in md
    assert "| outer_lr | 0.7 | — |" in md
    # Manifest summary: long title lists abbreviated.
    assert "| documents/train | 39 items: play 0, play 1, play 2, … |" in md
    assert "| tokens/train | 1,200,000 |" in md


def test_loss_gap_percent(built):
    run_dir, report, md = built
    # Hand computation: 100 × (3.30 − 3.00) / 3.00 = 100 × 0.30 / 3.00 = +10.00 %.
    gap = _stage(report)["loss_gaps"]["diloco"]
    assert gap["status"] == "ok" and (gap["method"], gap["baseline"]) == ("diloco", "dp")
    assert gap["gap_pct"] == pytest.approx(10.0)
    assert "+10.00% relative to DP's" in md


def test_merges_while_learner_down(built):
    run_dir, report, md = built
    (f,) = _method(report)["failures"]
    assert f["learner"] == 1 and f["failed_at_s"] == 8.0 and f["failed_at_step"] == 39
    # The retry event at 9 s is not the restart; the start of attempt 2 at 12 s is.
    assert f["restarted_at_s"] == 12.0 and f["downtime_s"] == 4.0
    assert f["merges_while_down"] == 3  # 8.5, 10.0, 11.5
    assert f["merges_while_down_by_fragment"] == {"0": 1, "1": 2}
    assert f["merges_while_down_with_learner"] == 1  # the stale one at 11.5
    assert f["merged_again_after_restart"] is True
    assert f["first_merge_with_learner_after_restart_s"] == 14.0
    assert f["restart_event"] == "start" and f["restart_attempt"] == 2
    assert (
        "| 1 | 1 | 8.0 | 39 | InjectedFailure('learner 1: injected failure at local step 40') | 12.0 "
        "| 4.0 | 3 | 0: 1, 1: 2 | 1 | yes |"
    ) in md


def test_downtime_window_is_half_open():
    events = [
        {"event": "failure", "learner": 2, "attempt": 0, "t": 5.0},
        {"event": "start", "learner": 2, "attempt": 1, "t": 9.0},
        {"event": "state", "state": "up", "learner": 2, "attempt": 1, "t": 9.0},
    ]
    merges = [  # at the failure instant counts, at the restart instant does not
        {"fragment": 0, "merged_at_s": 5.0, "contributors": [0]},
        {"fragment": 0, "merged_at_s": 9.0, "contributors": [0, 2]},
    ]
    (f,) = learner_failures(events, merges)
    assert f["merges_while_down"] == 1 and f["merged_again_after_restart"] is True
    # A learner that never comes back is down until the end of the run and never merged again.
    (g,) = learner_failures(events[:1], merges)
    assert g["restarted_at_s"] is None and g["merges_while_down"] == 2
    assert g["merged_again_after_restart"] is False


LEDGER_SENTENCE_END = (
    "per learner processed = submitted + not_submitted and submitted = merged + dropped + "
    "pending hold within ±2 tokens (P = 2)."
)


def test_ledger_table(built):
    run_dir, report, md = built
    led = _method(report)["ledger"]
    assert led["columns"] == [
        "processed",
        "submitted",
        "not_submitted",
        "merged",
        "dropped",
        "pending",
        "attempts",
        "drop_reasons",
    ]
    assert led["total"]["drop_reasons"] == {"stale": 1024}
    assert led["total"]["processed"] == 32768  # 18,432 + 14,336 = the method's tokens
    assert led["total"]["not_submitted"] == 2048
    assert led["rows"][1]["merged_pct"] == pytest.approx(100 * 10240 / 14336)  # 71.43 %
    assert led["identity_violations"] == [] and not led["not_submitted_computed"]
    assert (
        "| learner | processed | submitted | not_submitted | merged | dropped | pending | attempts "
        "| drop_reasons | merged % of processed |"
    ) in md
    assert "| 1 | 14,336 | 12,288 | 2,048 | 10,240 | 1,024 | 1,024 | 2 | stale: 1,024 | 71.4 |" in md
    assert "| total | 32,768 | 30,720 | 2,048 | 28,672 | 1,024 | 1,024 | 3 | stale: 1,024 | 87.5 |" in md
    # One sentence under the table: what each column means and the identities.
    section = md.split("### DiLoCo token ledger")[1].split("\n#")[0]
    (sentence,) = [line for line in section.splitlines() if line.startswith("Tokens per learner:")]
    for col in ("processed =", "submitted =", "not_submitted =", "merged =", "dropped =", "pending ="):
        assert col in sentence
    assert "progress overwritten when a newer global fragment arrived" in sentence
    assert sentence.endswith(LEDGER_SENTENCE_END) and sentence.count(". ") == 0
    assert "Ledger check failed" not in md
    # Learner events: the syncer's drop is counted; the last step is the stop's.
    assert "| 1 | 2 | 1 | 1 | 112 | stop (budget) |" in md


def test_ledger_without_not_submitted_and_fractional_counts(run_dir: Path):
    """An older summary: per-fragment averages (fractions) and no ``not_submitted``."""
    path = _layout(run_dir).summary(PRE, "diloco")
    summary = json.loads(path.read_text())
    summary["ledger"] = {
        "0": {
            "processed": 18432,
            "submitted": 18432.0,
            "merged": 18432.0,
            "dropped": 0.0,
            "pending": 0.0,
            "drop_reasons": {},
            "attempts": 1,
        },
        "1": {
            "processed": 14336,
            "submitted": 12287.75,
            "merged": 10240.25,
            "dropped": 1024.0,
            "pending": 1023.5,
            "drop_reasons": {"stale": 1024.0},
            "attempts": 2,
        },
    }
    _write(path, summary)
    report = build_report(run_dir)
    led = _method(report)["ledger"]
    assert led["not_submitted_computed"] and led["identity_violations"] == []
    row = led["rows"][1]
    assert row["not_submitted"] == 2048 and row["submitted"] == 12288  # 14,336 − 12,287.75, rounded
    assert all(
        isinstance(row[c], int) for c in ("processed", "submitted", "not_submitted", "merged", "dropped", "pending")
    )
    md = squash(_layout(run_dir).report_md.read_text())
    assert "| 1 | 14,336 | 12,288 | 2,048 | 10,240 | 1,024 | 1,024 | 2 | stale: 1,024 | 71.4 |" in md
    assert "computed here as processed − submitted" in md


def test_ledger_identity_violation_is_reported(run_dir: Path):
    path = _layout(run_dir).summary(PRE, "diloco")
    summary = json.loads(path.read_text())
    summary["ledger"]["1"]["merged"] = 10240 - 512  # 512 tokens unaccounted for (> P = 2)
    _write(path, summary)
    report = build_report(run_dir)
    (v,) = _method(report)["ledger"]["identity_violations"]
    assert v == {"learner": 1, "identity": "submitted = merged + dropped + pending", "difference": 512}
    md = squash(_layout(run_dir).report_md.read_text())
    assert "**Ledger check failed:** learner 1: submitted = merged + dropped + pending is off by +512" in md


def test_merge_bytes_out(built, run_dir: Path):
    _, report, md = built
    # 8 merges × (4,096 fragment bytes × 2 learners) published; submissions merged: 14 × 4,096.
    fig = _method(report)["bytes"]
    assert fig["published_out"] == 8 * 8192 and fig["merged_in"] == 14 * 4096
    assert "bytes_out (syncer publishes: fragment bytes × learners) 65,536 (64.0 KiB)." in md
    # Records written before bytes_out existed: "not recorded", never 0.
    path = _layout(run_dir).metrics(PRE, "diloco", "merges")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    _write_jsonl(path, [{k: v for k, v in r.items() if k != "bytes_out"} for r in rows])
    old = build_report(run_dir)
    assert _method(old)["bytes"]["published_out"] is None and _method(old)["bytes"]["merged_in"] == 14 * 4096
    old_md = squash(_layout(run_dir).report_md.read_text())
    assert "bytes_out (syncer publishes: fragment bytes × learners) not recorded." in old_md
    assert "| merge-log bytes_out: published, fragment bytes × M per merge | syncer | — |" in old_md
    # Some records with it, some without: still not a total, in the table and in the merges section.
    _write_jsonl(path, [{k: v for k, v in r.items() if k != "bytes_out" or i < 3} for i, r in enumerate(rows)])
    mixed = build_report(run_dir)
    assert _method(mixed)["bytes"]["published_out"] is None
    assert _method(mixed)["bytes"]["published_out_recorded"] == 3
    mixed_md = squash(_layout(run_dir).report_md.read_text())
    assert mixed_md.count("not recorded (in 3 of 8 merge records)") == 2


def test_loss_plot_final_is_the_last_row_when_tokens_tie(run_dir: Path):
    """Two rows at the last token count: the later row is the final value, even with a lower loss
    (sorting by (tokens, loss) would put 3.30 last and draw a jump down-then-up)."""
    path = _layout(run_dir).metrics(PRE, "diloco", "eval")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows.append({"method": "diloco", "tokens": 32768, "wall_s": 21.0, "step": 128, "val/loss": 3.28})
    _write_jsonl(path, rows)
    fig = loss_figure({"diloco": rows}, "tokens", "tokens", "loss")
    ax = fig.axes[0]
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0, 8192, 16384, 24576, 32768, 32768]
    assert list(line.get_ydata())[-2:] == [3.30, 3.28]  # file order kept for the tie
    assert [t.get_text() for t in ax.texts] == ["final 3.2800"]
    assert ax.texts[0].xy == (32768, 3.28)
    # In the report the annotation is the summary's final_val_loss (the flow's last evaluation).
    spath = _layout(run_dir).summary(PRE, "diloco")
    summary = json.loads(spath.read_text())
    summary["final_val_loss"] = 3.28
    _write(spath, summary)
    report = build_report(run_dir)
    final = _method(report)["final_val_loss"]
    assert final == 3.28 and _method(report)["curve"]["final_loss"] == 3.28
    assert not any("differs from the last eval-curve point" in n for n in _stage(report)["notes"])
    finals = {m: _method(report, m)["final_val_loss"] for m in ("diloco", "dp")}
    for x_key in ("tokens", "wall_s"):
        ax = loss_figure({"diloco": rows}, x_key, "x", "loss", finals).axes[0]
        assert [t.get_text() for t in ax.texts] == [f"final {final:.4f}"]


def test_plots_are_valid_images(built):
    run_dir, report, md = built
    plots = {**_stage(report)["plots"], **_method(report)["plots"]}
    assert _method(report, "dp").get("plots") is None  # no merges, no merge plot
    for name in ("loss_vs_tokens", "loss_vs_time", "merges_over_time"):
        file = f"pretrain_diloco_{name}.png" if name == "merges_over_time" else f"pretrain_{name}.png"
        assert plots[name] == file
        path = _layout(run_dir).report / file
        assert path.stat().st_size > 0
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 100
        pixels = matplotlib.image.imread(path)
        assert pixels.ndim == 3 and pixels.std() > 0  # not a blank canvas
        assert f"]({file})" in md


def test_report_json_round_trips(built):
    run_dir, report, md = built
    on_disk = json.loads((_layout(run_dir).report / "report.json").read_text())
    assert on_disk == report
    assert _stage(on_disk)["loss_gaps"]["diloco"]["gap_pct"] == pytest.approx(10.0)
    assert _method(on_disk)["failures"][0]["merges_while_down"] == 3


def test_missing_dp_summary_says_not_run(run_dir: Path):
    _layout(run_dir).summary(PRE, "dp").unlink()
    report = build_report(run_dir)
    assert _method(report, "dp")["status"] == NOT_RUN
    assert _row(report, "tokens")["dp"] == NOT_RUN
    # The eval curve still gives DP's final loss, so the gap is still defined.
    assert _row(report, "final_val_loss")["dp"] == 3.0
    assert _stage(report)["loss_gaps"]["diloco"]["gap_pct"] == pytest.approx(10.0)
    md = squash(_layout(run_dir).report_md.read_text())
    assert "| training tokens (tokens) | 32,768 | not run |" in md
    assert "Data-parallel pretraining: **not run**" in md


def test_a_completed_method_without_its_summary_is_refused(run_dir: Path):
    """A summary deleted (or a method's folder removed) after the run finished is not "not run":
    `ddiloco report` refuses in one line naming the file, and the good report stays as it was."""
    import shutil

    from tests.test_refusals import cli, one_line_refusal

    lay = _layout(run_dir)
    _write(
        lay.status,
        {
            "status": "completed",
            "completed_stages": ["data", "pretrain-diloco", "pretrain-dp", "eval-diloco", "eval-dp", "report"],
        },
    )
    build_report(run_dir)
    good = {p.name: p.read_bytes() for p in lay.report.iterdir()}
    lay.summary(PRE, "diloco").unlink()
    with pytest.raises(ReportInputError, match=r"pretrain/diloco/summary\.json: results missing"):
        build_report(run_dir)
    line = one_line_refusal(*cli("report", run_dir))
    assert "pretrain/diloco/summary.json: results missing" in line and "pretrain-diloco" in line
    assert {p.name: p.read_bytes() for p in lay.report.iterdir()} == good  # not overwritten
    # a method's whole folder removed
    _write(lay.summary(PRE, "diloco"), {"method": "diloco", "tokens": 32768})
    shutil.rmtree(lay.method_dir(PRE, "dp"))
    line = one_line_refusal(*cli("report", run_dir))
    assert "pretrain/dp/summary.json: results missing" in line
    # a completed run whose stage list does not name the method: its metrics without a summary
    lay.summary(PRE, "diloco").unlink()
    _write(lay.status, {"status": "completed", "completed_stages": ["data", "pretrain", "eval"]})
    with pytest.raises(ReportInputError, match=r"pretrain/diloco/summary\.json: results missing"):
        build_report(run_dir)
    assert {p.name: p.read_bytes() for p in lay.report.iterdir()} == good
    # an interrupted run: a method that did not complete reads "not run", as before
    _write(lay.status, {"status": "interrupted", "completed_stages": ["data"], "reason": "SIGTERM"})
    assert _method(build_report(run_dir))["status"] == NOT_RUN


def test_dp_disabled_and_eval_disabled(run_dir: Path):
    lay = _layout(run_dir)
    for p in (
        lay.summary(PRE, "dp"),
        lay.metrics(PRE, "dp", "eval"),
        lay.eval_result(PRE, "dp"),
        lay.eval_result(PRE, "diloco"),
    ):
        p.unlink()
    report = build_report(run_dir)
    assert list(_stage(report)["methods"]) == ["diloco", "dp"]  # the baseline's column says "not run"
    assert _stage(report)["loss_gaps"]["diloco"]["status"] == NOT_RUN
    assert not [r for r in _stage(report)["comparison"] if r["group"] == "eval"]
    assert _stage(report)["plots"]["loss_vs_tokens"] == "pretrain_loss_vs_tokens.png"  # DiLoCo's curve alone
    md = squash(_layout(run_dir).report_md.read_text())
    assert "**Loss gap:** not run" in md
    assert "*lm-eval: not run for either method.*" in md
    assert _row(report, "bytes_sent")["dp"] == NOT_RUN
    # One method evaluated: the other's cells read "not run".
    _write(lay.eval_result(PRE, "diloco"), {"heldout_nextline/acc": 0.5, "heldout_nextline/chance": 0.25})
    report = build_report(run_dir)
    assert _row(report, "heldout_nextline/acc")["dp"] == NOT_RUN
    assert "| heldout_nextline: accuracy (fraction) | 0.500 (chance 0.25) | not run |" in squash(
        lay.report_md.read_text()
    )


def test_empty_run_dir_does_not_crash(tmp_path: Path):
    lay = _layout(tmp_path)
    _write(lay.config, {"name": "empty"})  # a run that stopped right after it started
    report = build_report(tmp_path)
    assert report["stages"] == {}  # no stage holds a method: no section, no figure
    assert sorted(p.name for p in lay.report.iterdir()) == ["report.html", "report.json", "report.md"]
    assert "- training: **not run**" in squash(lay.report_md.read_text())
    # A stage whose DiLoCo summary exists but nothing else: every other part reads "not run".
    _write(lay.summary(PRE, "diloco"), {"method": "diloco"})
    report = build_report(tmp_path)
    assert _method(report, "dp")["status"] == NOT_RUN and _method(report)["status"] == "ok"
    assert _stage(report)["plots"] == {"loss_vs_tokens": None, "loss_vs_time": None}
    assert _method(report)["plots"] == {"merges_over_time": None}
    assert _method(report)["ledger"]["status"] == "not recorded" and _method(report)["failures"] == []
    assert _method(report)["merges"]["status"] == NOT_RUN
    assert sorted(p.name for p in lay.report.iterdir()) == ["report.html", "report.json", "report.md"]
    assert "*merge log: not run.*" in squash(lay.report_md.read_text())


@pytest.mark.parametrize("kind", ["missing", "not a run directory", "a file"])
def test_not_a_run_directory_is_refused(tmp_path: Path, kind: str):
    if kind == "missing":
        path = tmp_path / "runs" / "no-such-run"
    elif kind == "a file":
        path = tmp_path / "notes.txt"
        path.write_text("hello")
    else:
        path = tmp_path / "somewhere"
        (path / "metrics").mkdir(parents=True)  # neither config.json nor pretrain/
    with pytest.raises(ReportInputError) as info:
        build_report(path)
    msg = str(info.value)
    assert str(path) in msg and "config.json" in msg and "pretrain/" in msg
    assert not _layout(path).report.exists()
    if kind == "missing":
        assert not path.exists() and not path.parent.exists()


def test_run_dir_with_only_pretrain_is_accepted(run_dir: Path):
    _layout(run_dir).config.unlink()
    report = build_report(run_dir)
    assert report["run"]["name"] == run_dir.name and _method(report)["status"] == "ok"


def test_a_third_method_is_reported(run_dir: Path):
    """A pretrain-only run that also holds a method the report does not know (``other``: a summary,
    an eval curve and an evaluation): it gets its own column, curve and loss gap to DP
    (100 × (3.15 − 3.00) / 3.00 = +5.00 %), and DiLoCo and DP read as before."""
    lay = _layout(run_dir)
    _write(
        lay.summary(PRE, "other"),
        {
            "method": "other",
            "hyperparameters": {"inner": INNER},
            "tokens": 32768,
            "steps": 128,
            "wall_s": 24.0,
            "final_val_loss": 3.15,
            "bytes_to_syncer": 1000,
            "bytes_from_syncer": 3000,
        },
    )
    _write_jsonl(
        lay.metrics(PRE, "other", "eval"),
        [
            {"method": "other", "tokens": t, "wall_s": 6.0 * i, "val/loss": loss}
            for i, (t, loss) in enumerate(zip([0, 16384, 32768], [6.2, 3.5, 3.15]))
        ],
    )
    _write(lay.eval_result(PRE, "other"), {"heldout_nextline/acc": 0.33, "heldout_nextline/chance": 0.25})
    report = build_report(run_dir)
    st = _stage(report)
    assert list(report["stages"]) == [PRE] and list(st["methods"]) == ["diloco", "dp", "other"]
    other = st["methods"]["other"]
    assert other["status"] == "ok" and other["kind"] == "plain" and "ledger" not in other
    assert (other["tokens"], other["tokens_per_s"]) == (32768, pytest.approx(32768 / 24.0))
    assert (other["bytes"]["sent"], other["bytes"]["received"], other["bytes"]["total"]) == (1000, 3000, 4000)
    assert _row(report, "tokens")["other"] == 32768 and _row(report, "merges")["other"] is None
    assert _row(report, "heldout_nextline/acc")["other"] == 0.33
    assert st["loss_gaps"]["other"]["gap_pct"] == pytest.approx(5.0)
    assert st["loss_gaps"]["diloco"]["gap_pct"] == pytest.approx(10.0)  # unchanged by the third method
    assert _row(report, "final_val_loss")["diloco"] == 3.3 and _method(report)["ledger"]["total"]["processed"] == 32768
    md = squash(lay.report_md.read_text())
    assert "### DiLoCo, other vs data-parallel" in md
    assert "| metric | Decoupled DiLoCo | Data-parallel | other |" in md
    assert "| training tokens (tokens) | 32,768 | 32,768 | 32,768 |" in md
    assert "**Loss gap, other vs DP:** other's final held-out loss is +5.00% relative to DP's" in md
    assert "**Loss gap, DiLoCo vs DP:** DiLoCo's final held-out loss is +10.00% relative to DP's" in md
    assert (
        "| heldout_nextline: accuracy (fraction) | 0.310 ± 0.035 (chance 0.25) | 0.345 ± 0.034 (chance 0.25) "
        "| 0.330 (chance 0.25) |" in md
    )
    assert "### other token ledger" not in md  # no ledger, merges or chaos sections for it
    curves = {m: [json.loads(x) for x in lay.metrics(PRE, m, "eval").read_text().splitlines()] for m in st["methods"]}
    legend = loss_figure(curves, "tokens", "tokens", "loss").axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["Decoupled DiLoCo", "Data-parallel", "other"]


def test_stages_are_reported_apart(run_dir: Path):
    """A fine-tuning stage beside pretraining: its own section, figures and comparison; a method it
    lacks (DP) reads "not run" there only."""
    lay = _layout(run_dir)
    _write(lay.summary("finetune", "diloco"), {"method": "diloco", "tokens": 4096, "final_val_loss": 2.5})
    _write_jsonl(
        lay.metrics("finetune", "diloco", "eval"),
        [
            {"method": "diloco", "tokens": 0, "wall_s": 0.0, "val/loss": 3.3},
            {"method": "diloco", "tokens": 4096, "wall_s": 2.0, "val/loss": 2.5},
        ],
    )
    report = build_report(run_dir)
    assert list(report["stages"]) == ["pretrain", "finetune"]
    ft = _stage(report, "finetune")
    assert _row(report, "tokens", "finetune")["diloco"] == 4096 and _row(report, "tokens")["diloco"] == 32768
    assert ft["methods"]["dp"]["status"] == NOT_RUN and ft["loss_gaps"]["diloco"]["status"] == NOT_RUN
    assert ft["plots"]["loss_vs_tokens"] == "finetune_loss_vs_tokens.png"
    assert ft["methods"]["diloco"]["plots"] == {"merges_over_time": None}  # no merge log in this stage
    assert (lay.report / "finetune_loss_vs_tokens.png").stat().st_size > 0
    md = squash(lay.report_md.read_text())
    assert md.index("## Pretraining") < md.index("## Fine-tuning") < md.index("## Data")
    assert "- Data-parallel fine-tuning: **not run**" in md and "- Data-parallel pretraining" not in md
    assert "| training tokens (tokens) | 4,096 | not run |" in md.split("## Fine-tuning")[1]


def test_a_run_on_fsspec_storage(run_dir: Path):
    """The same run under a ``memory://`` URL: read and written through the layout's UPaths."""
    from upath import UPath

    root = UPath(f"memory:///report-test/{uuid.uuid4().hex[:8]}/{run_dir.name}")
    for p in run_dir.rglob("*"):
        if p.is_file():
            q = root / p.relative_to(run_dir).as_posix()
            q.parent.mkdir(parents=True, exist_ok=True)
            q.write_bytes(p.read_bytes())
    report = build_report(str(root))
    assert report["run"]["run_dir"] == str(root) and _row(report, "tokens")["diloco"] == 32768
    out = RunLayout(root).report
    assert json.loads((out / "report.json").read_text()) == report
    assert (out / "pretrain_loss_vs_tokens.png").read_bytes()[:4] == b"\x89PNG"


def test_report_cites_the_paper(built):
    _, _, md = built
    assert "Douillard et al." in md and "arXiv 2604.21428" in md
    import reports

    assert "arXiv 2604.21428" in Path(reports.__file__).read_text()
    for src in Path(reports.__file__).parent.glob("*.py"):
        assert "shared/docs" not in src.read_text(), src


def test_corrupt_json_names_the_file(run_dir: Path):
    bad = _layout(run_dir).summary(PRE, "diloco")
    bad.write_text('{"tokens": 32768, ')
    with pytest.raises(ReportInputError, match=r"pretrain/diloco/summary\.json: corrupt JSON"):
        build_report(run_dir)


def test_corrupt_jsonl_names_file_and_line(run_dir: Path):
    path = _layout(run_dir).metrics(PRE, "diloco", "merges")
    path.write_text(path.read_text() + '{"fragment": 0, "merged_at\n')
    with pytest.raises(ReportInputError, match=r"pretrain/diloco/metrics/merges\.jsonl: corrupt JSON on line 9"):
        build_report(run_dir)


def test_a_last_line_cut_short_is_dropped_with_a_note(run_dir: Path, caplog):
    """A SIGKILL mid-append leaves the last line of a metrics file cut short, with no newline: the
    report drops that line, says so in its notes and the log, and reads the rest."""
    path = _layout(run_dir).metrics(PRE, "diloco", "merges")
    whole = read_jsonl(path)
    path.write_text(path.read_text() + '{"fragment": 0, "merged_at')  # no trailing newline
    with caplog.at_level("WARNING"):
        report = build_report(run_dir)
    dropped = (
        "pretrain/diloco/metrics/merges.jsonl: its last line (line 9) is cut short (no newline; a write "
        "stopped part-way) and was left out."
    )
    assert dropped in caplog.text
    assert dropped in report["stages"]["pretrain"]["notes"]
    assert f"- {dropped}" in squash(_layout(run_dir).report_md.read_text())
    assert read_jsonl(path, notes=[]) == whole  # every whole line is kept
    path.write_text(path.read_text() + '}\n{"fragment": 1')  # now line 9 is corrupt in the middle
    with pytest.raises(ReportInputError, match=r"merges\.jsonl: corrupt JSON on line 9"):
        read_jsonl(path, notes=[])


def test_a_writer_reopening_a_file_cut_short_drops_the_partial_line(tmp_path, caplog):
    """A resumed stage reopens its metrics file after a kill mid-append: the partial line goes (with
    a warning) and the next record is a line of its own, so the whole file reads back."""
    from run.metrics import JsonlWriter

    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    with caplog.at_level("WARNING"):
        writer = JsonlWriter(path)
    writer({"step": 3})
    writer.close()
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}, {"step": 3}]
    assert "dropped a last line cut short (15 bytes)" in caplog.text
    path.write_text('{"step": 1, "lo')  # no whole line at all
    JsonlWriter(path).close()
    assert path.read_text() == ""


def test_artifact_key_is_prefect_safe():
    assert artifact_key("report", "My Run_v2.1") == "report-my-run-v2-1"
    assert artifact_key("ledger", "--") == "ledger-run"


def test_publish_outside_a_run_is_refused(run_dir: Path):
    report = build_report(run_dir)
    with pytest.raises(RuntimeError, match="inside a Prefect flow or task run"):
        publish_report_artifacts(report, run_dir)


def test_publish_inside_a_flow(run_dir: Path, prefect_harness):
    """Needs the session-wide ``prefect_harness`` fixture from the project's conftest; we never
    start a Prefect server here. The server is shared with other tests (the end-to-end flows
    publish ``report-tiny`` too), so this run gets a name of its own and the artifacts are read
    back by key *and* by this flow run's id."""
    from prefect import flow
    from prefect.artifacts import create_markdown_artifact
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.runtime import flow_run

    name = f"tiny-publish-{uuid.uuid4().hex[:8]}"
    config = json.loads(_layout(run_dir).config.read_text())
    _write(_layout(run_dir).config, {**config, "name": name})
    report = build_report(run_dir)
    assert report["run"]["name"] == name

    @flow
    def decoy() -> None:  # what another test of the session may have left under the usual key
        create_markdown_artifact("another run's report", key="report-tiny")

    @flow
    def publish() -> str:
        publish_report_artifacts(report, run_dir)
        return flow_run.id

    decoy()
    run_id = publish()
    keys = [artifact_key(p, name) for p in ("report", "comparison", "ledger")]
    assert keys == [f"report-{name}", f"comparison-{name}", f"ledger-{name}"]
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=keys), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])
            )
        )
    assert sorted(a.key for a in arts) == sorted(keys)  # one each, all from this flow run
    by_key = {a.key: a for a in arts}
    assert "+10.00%" in by_key[f"report-{name}"].data
    assert str(run_dir.resolve()) in by_key[f"report-{name}"].description
    table = by_key[f"comparison-{name}"].data
    table = json.loads(table) if isinstance(table, str) else table
    assert {"stage": "pretrain", "metric": "training tokens (tokens)", "diloco": "32,768", "dp": "32,768"} in table
    assert {"stage": "pretrain", "metric": "loss gap DiLoCo vs DP (%)", "diloco": "+10.00", "dp": ""} in table
    ledger = by_key[f"ledger-{name}"].data
    ledger = json.loads(ledger) if isinstance(ledger, str) else ledger
    assert {
        "stage": "pretrain",
        "method": "diloco",
        "learner": "1",
        "processed": 14336,
        "submitted": 12288,
        "not_submitted": 2048,
        "merged": 10240,
        "dropped": 1024,
        "pending": 1024,
        "attempts": 2,
        "drop_reasons": '{"stale": 1024}',
        "merged_pct": pytest.approx(100 * 10240 / 14336),
    } in ledger


# --------------------------------------------------------------------------------------------
# Every figure against the raw logs; chaos events; lost work; pipeline status; eval extras
# --------------------------------------------------------------------------------------------

FIGURE_MERGES = [  # (merged_at_s, fragment, contributors, stale versions behind, fragment bytes)
    (1.0, 0, [0, 1, 2], [0, 0, 0], 1000),
    (1.5, 1, [0, 1], [0, 0], 1200),
    (3.0, 0, [0, 2], [0, 1], 1000),
    (4.0, 1, [1], [2], 1200),
    (5.0, 0, [0, 1, 2], [0, 0, 1], 1000),
]


def _make_figures_run(root: Path) -> Path:
    """3 learners, 2 fragments of unequal size (1,000 and 1,200 bytes), hand-made byte counts that
    share no value by accident, a DP baseline of 3 simulated workers with 3,300 gradient bytes over
    10 steps (ring: 2 × 2/3 × 3,300 = 4,400 sent per worker per step), two scheduled failures of
    which only one fires (learner 2 at local step 6; learner 0 at local step 40 never does)."""
    run = _make_run(root)
    lay = _layout(run)
    config = json.loads(lay.config.read_text())
    config["diloco"].update(learners=3, fragments=2)
    config["chaos"] = {"failures": [{"learner": 2, "at_step": 6}, {"learner": 0, "at_step": 40}]}
    _write(lay.config, config)
    _write_jsonl(
        lay.metrics(PRE, "diloco", "merges"),
        [
            {
                "fragment": f,
                "version": 1 + sum(1 for x in FIGURE_MERGES[:i] if x[1] == f),
                "contributors": c,
                "weights": [1 / len(c)] * len(c),
                "tokens": [512] * len(c),
                "steps": [2] * len(c),
                "stale": s,
                "local_steps": [2] * len(c),
                "quorum_at_s": t - 0.25,
                "merged_at_s": t,
                "bytes_in": fb * len(c),
                "fragment_bytes": fb,
                "bytes_out": fb * 3,
                "outer_grad_norm": 0.5,
            }
            for i, (t, f, c, s, fb) in enumerate(FIGURE_MERGES)
        ],
    )
    _write_jsonl(
        lay.metrics(PRE, "diloco", "learners"),
        [
            {"event": "start", "learner": 0, "attempt": 1, "step": 0, "t": 0.0},
            {"event": "start", "learner": 1, "attempt": 1, "step": 0, "t": 0.0},
            {"event": "start", "learner": 2, "attempt": 1, "step": 0, "t": 0.0},
            {
                "event": "failure",
                "learner": 2,
                "attempt": 1,
                "step": 5,
                "t": 2.5,
                "reason": "InjectedFailure('learner 2: injected failure at local step 6')",
            },
            {"event": "start", "learner": 2, "attempt": 2, "step": 5, "t": 3.5},
            {"event": "stop", "learner": 0, "attempt": 1, "step": 12, "t": 6.0},
            {"event": "stop", "learner": 1, "attempt": 1, "step": 11, "t": 6.0},
            {"event": "stop", "learner": 2, "attempt": 2, "step": 9, "t": 6.0},
            *(
                {"event": "state", "state": s, "learner": m, "attempt": a, "t": t}
                for m, s, a, t in [(0, "up", 1, 0.0), (1, "up", 1, 0.0), (2, "up", 1, 0.0), (2, "down", 1, 2.5)]
                + [(2, "up", 2, 3.5), (0, "done", 1, 6.0), (1, "done", 1, 6.0), (2, "done", 2, 6.0)]
            ),
            {
                "event": "dropped",
                "learner": 1,
                "fragment": 1,
                "reason": "stale",
                "tokens": 256,
                "base_version": 0,
                "t": 4.5,
                "source": "syncer",
            },
        ],
    )
    _write(
        lay.summary(PRE, "diloco"),
        {
            "method": "diloco",
            "hyperparameters": {"learners (M)": 3, "fragments (P)": 2},
            "tokens": 16_384,
            "steps": 32,
            "wall_s": 6.0,
            "tokens_per_s": 16_384 / 6.0,
            "final_val_loss": 3.30,
            "merges": 5,
            "bytes_to_syncer": 13_100,
            "bytes_merged": 11_600,
            "bytes_from_syncer": 15_400,
            "fragment_bytes": [1000, 1200],
            "ledger": {
                "0": {
                    "processed": 6144,
                    "submitted": 6144,
                    "not_submitted": 0,
                    "merged": 6144,
                    "dropped": 0,
                    "pending": 0,
                    "drop_reasons": {},
                    "attempts": 1,
                },
                "1": {
                    "processed": 5632,
                    "submitted": 5120,
                    "not_submitted": 512,
                    "merged": 4608,
                    "dropped": 256,
                    "pending": 256,
                    "drop_reasons": {"stale": 256},
                    "attempts": 1,
                },
                "2": {
                    "processed": 4608,
                    "submitted": 4096,
                    "not_submitted": 512,
                    "merged": 4096,
                    "dropped": 0,
                    "pending": 0,
                    "drop_reasons": {},
                    "attempts": 2,
                },
            },
            "params": 825,
            "flops_per_token": 4950.0,
        },
    )
    _write(
        lay.summary(PRE, "dp"),
        {
            "method": "dp",
            "hyperparameters": {"simulated workers": 3},
            "tokens": 16_384,
            "steps": 10,
            "wall_s": 9.0,
            "tokens_per_s": 16_384 / 9.0,
            "final_val_loss": 3.00,
            "merges": None,
            "bytes_to_syncer": 132_000,
            "bytes_from_syncer": 132_000,
            "allreduce_bytes": 264_000,
            "params": 825,
            "flops_per_token": 4950.0,
        },
    )
    _write(
        lay.eval_result(PRE, "diloco"),
        {
            "method": "diloco",
            "heldout_nextline/acc": 0.412,
            "heldout_nextline/acc_stderr": 0.035,
            "heldout_nextline/chance": 0.25,
            "heldout_cloze/acc": 0.5,
            "heldout_cloze/acc_stderr": 0.05,
            "heldout_cloze/chance": 0.2,
            "truncated_requests": 7,
            "eval_s": 3.0,
        },
    )
    _write(
        lay.eval_result(PRE, "dp"),
        {
            "method": "dp",
            "heldout_nextline/acc": 0.43,
            "heldout_nextline/acc_stderr": 0.0351,
            "heldout_nextline/chance": 0.25,
            "heldout_cloze/acc": 0.55,
            "heldout_cloze/acc_stderr": 0.049,
            "heldout_cloze/chance": 0.2,
            "truncated_requests": 0,
            "eval_s": 2.5,
        },
    )
    return run


def _fmt_bytes(n: float) -> str:
    """Written out independently of the report's formatter: "12,345 (12.1 KiB)"."""
    units, x, unit = ["KiB", "MiB", "GiB"], float(n), ""
    while abs(x) >= 1024 and units:
        x, unit = x / 1024, units.pop(0)
    return f"{round(n):,}" + (f" ({x:.1f} {unit})" if unit else "")


def _md_row(md: str, first_cell: str) -> list[str]:
    (line,) = [ln for ln in md.splitlines() if ln.startswith(f"| {first_cell} |")]
    return [c.strip() for c in line.strip("|").split(" | ")]


def test_bytes_per_token_against_dps_allreduce_of_the_same_model(tmp_path: Path):
    """The figures run with int4 learners (blocks of 64) and a DP config of W = 3 workers, 8 × 64 =
    512 tokens a step. DiLoCo sent 13,100 bytes over 16,384 tokens = 0.7996 a token; DP's ring
    all-reduce of the same model (825 float32 parameters: G = 3,300 bytes) sends 2(W − 1) × G =
    13,200 bytes a step, 25.78 a token: 32.2× as many. The DP column's per-token figure is its own
    summary's: 132,000 sent ÷ 16,384 tokens = 8.06."""
    run = _make_figures_run(tmp_path)
    lay = _layout(run)
    config = json.loads(lay.config.read_text())
    config["diloco"]["wire"] = {"dtype": "int4", "block_size": 64}
    config["dp"].update(workers=3, batch_size=8)
    _write(lay.config, config)
    report = build_report(run)
    md = squash(lay.report_md.read_text())
    fig = _method(report)["bytes"]
    assert (
        fig["wire"] == "int4:64"
        and report["setup"]["wire format (learner→syncer; syncer→learner is float32)"] == "int4:64"
    )
    assert fig["sent_per_token"] == pytest.approx(13_100 / 16_384)
    assert fig["dp_allreduce"] == {
        "sent_per_token": pytest.approx(13_200 / 512),
        "workers": 3,
        "gradient_bytes": 3300,
        "tokens_per_step": 512,
    }
    assert fig["sent_vs_dp"] == pytest.approx((13_200 / 512) / (13_100 / 16_384))
    row = _row(report, "bytes_sent_per_token")
    assert row["diloco"] == pytest.approx(0.79956, abs=1e-5) and row["dp"] == pytest.approx(132_000 / 16_384)
    assert _md_row(md, row["label"])[2:] == ["0.8", "8.1"]
    assert (
        "DiLoCo's learners sent 0.8 bytes per training token (wire format int4:64: its update Δ = θ − Θ_base; "
        "the syncer publishes float32). DP's ring all-reduce of this model's float32 gradient (3,300 bytes, "
        "W = 3 workers, 512 tokens per step) sends 2(W − 1) × 3,300 ÷ 512 = 25.8 bytes per token, 32.2× as "
        "many as DiLoCo's learners."
    ) in md
    # a config from before wire formats: float32, and no DP config, no comparison line
    del config["diloco"]["wire"]
    _write(lay.config, config)
    assert _method(build_report(run))["bytes"]["wire"] == "float32"


def test_every_figure_matches_the_raw_logs(tmp_path: Path):
    run = _make_figures_run(tmp_path)
    report = build_report(run)
    on_disk = json.loads((_layout(run).report / "report.json").read_text())
    md = squash(_layout(run).report_md.read_text())
    assert on_disk == report

    # Expected figures, straight from the raw files.
    lay = _layout(run)
    read = lambda p: json.loads(p.read_text())  # noqa: E731
    merges = [json.loads(x) for x in lay.metrics(PRE, "diloco", "merges").read_text().splitlines()]
    events = [json.loads(x) for x in lay.metrics(PRE, "diloco", "learners").read_text().splitlines()]
    ds, ps, cfg = read(lay.summary(PRE, "diloco")), read(lay.summary(PRE, "dp")), read(lay.config)
    M = cfg["diloco"]["learners"]
    W = ps["hyperparameters"]["simulated workers"]
    bytes_in, bytes_out = sum(m["bytes_in"] for m in merges), sum(m["bytes_out"] for m in merges)
    contributions = sum(len(m["contributors"]) for m in merges)
    stale = sum(1 for m in merges for s in m["stale"] if s > 0)
    by_frag = {str(f): sum(1 for m in merges if m["fragment"] == f) for f in (0, 1)}
    dp_sent = dp_recv = ps["allreduce_bytes"] / 2  # the contract: half sent, half received
    expect = {
        "diloco": {
            "sent": ds["bytes_to_syncer"],
            "received": ds["bytes_from_syncer"],
            "total": ds["bytes_to_syncer"] + ds["bytes_from_syncer"],
            "sent_per_learner": ds["bytes_to_syncer"] / M,
            "received_per_learner": ds["bytes_from_syncer"] / M,
            "merged_in": bytes_in,
            "published_out": bytes_out,
        },
        "dp": {
            "sent": dp_sent,
            "received": dp_recv,
            "total": ps["allreduce_bytes"],
            "sent_per_worker": dp_sent / W,
            "received_per_worker": dp_recv / W,
        },
    }
    # Hand check of the hand-made numbers: the ring moves 2 × (W − 1)/W × 3,300 bytes per worker per
    # step each way, 10 steps; the merge log's totals by hand.
    assert dp_sent == 2 * (W - 1) * 3300 * 10 == 132_000  # = 2(W − 1)/W × 3,300 × W workers × 10 steps
    assert bytes_in == 3 * 1000 + 2 * 1200 + 2 * 1000 + 1200 + 3 * 1000 == 11_600
    assert bytes_out == 3 * (3 * 1000) + 2 * (3 * 1200) == 16_200
    assert ds["bytes_merged"] == bytes_in

    # report.json: one byte figure each, equal to the raw value.
    for m, figs in expect.items():
        for k, v in figs.items():
            assert _method(report, m)["bytes"][k] == pytest.approx(v), (m, k)
    assert _stage(report)["notes"] == []  # nothing disagrees, so nothing to explain
    # The table rows read those same values.
    row_of = {
        "bytes_sent": ("sent", "sent"),
        "bytes_received": ("received", "received"),
        "bytes_total": ("total", "total"),
        "bytes_sent_per_worker": ("sent_per_learner", "sent_per_worker"),
        "bytes_received_per_worker": ("received_per_learner", "received_per_worker"),
        "bytes_merged_in": ("merged_in", None),
        "bytes_published_out": ("published_out", None),
    }
    for key, (dk, pk) in row_of.items():
        row = _row(report, key)
        assert row["group"] == "bytes" and row["diloco"] == pytest.approx(expect["diloco"][dk])
        assert row["dp"] == (pytest.approx(expect["dp"][pk]) if pk else "n/a (no syncer)")
    # Merge, token and failure figures.
    mg = _method(report)["merges"]
    assert (
        (mg["count"], mg["by_fragment"], mg["contributions"], mg["stale_contributions"])
        == (len(merges), by_frag, contributions, stale)
        == (5, {"0": 3, "1": 2}, 11, 3)
    )
    assert mg["max_stale_versions"] == max(s for m in merges for s in m["stale"]) == 2
    assert mg["mean_contributors"] == pytest.approx(contributions / len(merges))
    assert _row(report, "merges")["diloco"] == len(merges) == ds["merges"]
    assert _row(report, "tokens")["diloco"] == ds["tokens"] and _row(report, "tokens")["dp"] == ps["tokens"]
    led = _method(report)["ledger"]["total"]
    for c in ("processed", "submitted", "not_submitted", "merged", "dropped", "pending"):
        assert led[c] == sum(v[c] for v in ds["ledger"].values()), c
    (f,) = _method(report)["failures"]
    fail = next(e for e in events if e["event"] == "failure")
    back = next(e for e in events if e["event"] == "start" and e["learner"] == 2 and e["attempt"] == 2)
    down = [m for m in merges if fail["t"] <= m["merged_at_s"] < back["t"]]
    assert (f["failed_at_s"], f["restarted_at_s"], f["merges_while_down"]) == (fail["t"], back["t"], len(down))

    # report.md: every place shows the same value.
    bytes_rows = {r["key"]: r["label"] for r in _stage(report)["comparison"] if r["group"] == "bytes"}
    for key, (dk, pk) in row_of.items():
        cells = _md_row(md, bytes_rows[key])
        assert cells[2] == _fmt_bytes(expect["diloco"][dk]), key
        assert cells[3] == (_fmt_bytes(expect["dp"][pk]) if pk else "n/a (no syncer)"), key
    assert _md_row(md, bytes_rows["bytes_sent"])[1] == "learners (DiLoCo) / ring model (DP)"
    # DP's sent and received are half the all-reduce bytes: the whole figure appears once (the total).
    assert md.count(_fmt_bytes(ps["allreduce_bytes"])) == 1
    assert md.count(_fmt_bytes(dp_sent)) == 2
    # The merges section repeats the merge-log totals: the same figures as the table.
    assert (
        f"bytes_in (submission bytes merged) {_fmt_bytes(bytes_in)}; bytes_out (syncer publishes: "
        f"fragment bytes × learners) {_fmt_bytes(bytes_out)}."
    ) in md
    assert md.count(_fmt_bytes(bytes_in)) == 2 and md.count(_fmt_bytes(bytes_out)) == 2
    assert md.count(_fmt_bytes(ds["bytes_from_syncer"])) == 1  # pulled bytes: one figure, one place
    assert f"{len(merges)} merges (fragment 0: 3, fragment 1: 2); mean contributors per merge 2.20;" in md
    assert (
        f"Stale contributions: {stale} of {contributions} contributions to merges, at most 2 versions "
        "behind (a stale contribution is a submission merged into a global fragment newer than the one "
        "it was based on"
    ) in md
    assert _md_row(md, "merges (DiLoCo) (merges)")[1:] == [f"{len(merges)}", "—"]
    assert _md_row(md, "training tokens (tokens)")[1:] == [f"{ds['tokens']:,}", f"{ps['tokens']:,}"]
    assert _md_row(md, "total")[1:7] == [
        f"{led[c]:,}" for c in ("processed", "submitted", "not_submitted", "merged", "dropped", "pending")
    ]
    # The byte convention is stated in the report.
    assert "half sent, half received" in md and "syncer→learner pulled bytes" in md
    assert "learner→syncer submission payload bytes" in md


def test_old_dp_summary_with_both_fields_equal_to_allreduce(run_dir: Path):
    """Summaries written before the fix carried the one-direction total in all three fields: the
    report shows their sent and received fields and says why the total is not allreduce_bytes."""
    path = _layout(run_dir).summary(PRE, "dp")
    summary = json.loads(path.read_text())
    summary.update(bytes_to_syncer=63_209_472, bytes_from_syncer=63_209_472, allreduce_bytes=63_209_472)
    _write(path, summary)
    report = build_report(run_dir)
    dp = _method(report, "dp")["bytes"]
    assert (dp["sent"], dp["received"], dp["total"]) == (63_209_472, 63_209_472, 126_418_944)
    assert any("counted both directions" in n for n in _stage(report)["notes"])
    # Only allreduce_bytes: split evenly.
    for k in ("bytes_to_syncer", "bytes_from_syncer"):
        summary.pop(k)
    summary["allreduce_bytes"] = 126_418_944
    _write(path, summary)
    dp = _method(build_report(run_dir), "dp")["bytes"]
    assert (dp["sent"], dp["received"], dp["total"], dp["sent_per_worker"]) == (
        63_209_472,
        63_209_472,
        126_418_944,
        31_604_736,
    )


def test_chaos_events_fired_and_not_fired(tmp_path: Path):
    run = _make_figures_run(tmp_path)
    report = build_report(run)
    fired, missed = _method(report)["chaos"]["rows"]
    assert (fired["learner"], fired["at_step"], fired["fired"], fired["fired_at_s"], fired["rejoined_at_s"]) == (
        2,
        6,
        True,
        2.5,
        3.5,
    )
    assert (missed["learner"], missed["at_step"], missed["fired"], missed["fired_at_s"]) == (0, 40, False, None)
    md = squash(_layout(run).report_md.read_text())
    assert "| scheduled event | fired | at t (s) | rejoined at t (s) | note |" in md
    assert "| learner 2 fails at local step 6 | yes | 2.5 | 3.5 | — |" in md
    assert "| learner 0 fails at local step 40 | no | did not fire | — | learner 0's last logged step: 12 |" in md

    # No failure fired at all: the report must not read as if none was scheduled.
    path = _layout(run).metrics(PRE, "diloco", "learners")
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    _write_jsonl(path, [r for r in rows if r["event"] != "failure" and r.get("attempt") != 2])
    report = build_report(run)
    assert [r["fired"] for r in _method(report)["chaos"]["rows"]] == [False, False]
    assert _method(report)["failures"] == []
    md = squash(_layout(run).report_md.read_text())
    assert "No learner failures were logged, although 2 were scheduled: they did not fire" in md
    assert "No learner failures." not in md

    # An injected failure at another step does not count ("at local step 5" is not step 40 or 6).
    _write_jsonl(
        path,
        rows[:3]
        + [{**rows[3], "reason": "InjectedFailure('learner 2: injected failure at local step 60')"}]
        + rows[4:],
    )
    report = build_report(run)
    assert [r["fired"] for r in _method(report)["chaos"]["rows"]] == [False, False]
    assert _method(report)["chaos"]["unscheduled_failures"] == 1
    # Nothing scheduled.
    cfg = json.loads(_layout(run).config.read_text())
    cfg["chaos"] = {"failures": []}
    _write(_layout(run).config, cfg)
    build_report(run)
    # (no drawn schedule either: the text does not point to a Resilience section the report lacks)
    md = squash(_layout(run).report_md.read_text())
    assert "No step-scheduled failures or kills (config chaos.events holds no fail at a step and no kill)." in md
    assert "### Resilience" not in md and "are in *Resilience*" not in md


def test_a_learner_back_after_the_budget_was_spent_is_not_said_to_have_rejoined_the_training(tmp_path: Path):
    """A scheduled failure whose retry starts when the others have spent the budget: its next attempt
    stops at the step it started from, and the row says so (a fresh user read "rejoined" as training)."""
    run = _make_figures_run(tmp_path)
    path = _layout(run).metrics(PRE, "diloco", "learners")
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    start = next(r for r in rows if r["event"] == "start" and r["learner"] == 2 and r.get("attempt") == 2)
    rows = [r for r in rows if not (r["event"] == "stop" and r["learner"] == 2 and r.get("attempt") == 2)]
    rows.append({"event": "stop", "learner": 2, "attempt": 2, "step": start["step"], "t": start["t"] + 0.1})
    _write_jsonl(path, rows)
    fired = _method(build_report(run))["chaos"]["rows"][0]
    assert fired["rejoined_at_s"] == 3.5
    assert fired["note"] == "it rejoined after the others had spent the budget: no step after the restart"
    assert (
        "| learner 2 fails at local step 6 | yes | 2.5 | 3.5 | it rejoined after the others had spent the budget"
        in (squash(_layout(run).report_md.read_text()))
    )


def test_sigkilled_learner_and_syncer_in_the_report(tmp_path: Path):
    """A chaos SIGKILL leaves only the event logged just before it: the report counts it as the
    learner's failure (down until its next start), matches it to its kill event in chaos.events, and shows
    a killed syncer with the next syncer's recovery; the setup names the engine and exchange."""
    run = _make_figures_run(tmp_path)
    cfg = json.loads(_layout(run).config.read_text())
    cfg["chaos"] = {
        "events": [
            {"kind": "kill", "learner": 1, "at_step": 5},
            {"kind": "kill", "learner": 0, "at_s": 9.5},
            {"kind": "syncer_fail", "at_merge": 2, "when": "before_publish", "how": "sigkill"},
        ],
    }
    cfg["runtime"] = {"engine": "dask", "exchange": None, "exchange_url": None}
    _write(_layout(run).config, cfg)
    path = _layout(run).metrics(PRE, "diloco", "learners")
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows = [r for r in rows if r["event"] != "failure" and r.get("state") != "down" and r.get("attempt") != 2]
    rows += [
        {"event": "kill", "learner": 1, "attempt": 1, "step": 4, "t": 2.0, "reason": "chaos: SIGKILL at local step 5"},
        {"event": "state", "state": "down", "learner": 1, "attempt": 1, "t": 2.0},
        {"event": "start", "learner": 1, "attempt": 2, "step": 0, "t": 4.5, "resumed": False},
        {"event": "state", "state": "up", "learner": 1, "attempt": 2, "t": 4.5},
        {
            "event": "syncer-kill",
            "role": "syncer",
            "attempt": 1,
            "generation": 1,
            "merges": 2,
            "t": 3.0,
            "reason": "chaos: SIGKILL (syncer: injected failure at merge 2 (before publish))",
        },
        {
            "event": "syncer-resumed",
            "role": "syncer",
            "attempt": 2,
            "generation": 2,
            "t": 7.5,
            "replayed": 2,
            "republished": 1,
            "merges": 2,
        },
    ]
    _write_jsonl(path, rows)
    report = build_report(run)
    m = _method(report)
    killed, timed = m["chaos"]["rows"]
    assert (killed["kind"], killed["fired"], killed["fired_at_s"], killed["rejoined_at_s"]) == ("kill", True, 2.0, 4.5)
    assert (timed["kind"], timed["at_s"], timed["fired"]) == ("kill", 9.5, False)
    (down,) = m["failures"]
    assert (down["learner"], down["failed_at_step"], down["downtime_s"]) == (1, 4, 2.5)
    (restart,) = m["syncer_restarts"]
    assert (
        restart["how"],
        restart["merges_before"],
        restart["downtime_s"],
        restart["generation"],
        restart["replayed"],
        restart["republished"],
    ) == ("SIGKILL", 2, 4.5, 2, 2, 1)
    md = squash(_layout(run).report_md.read_text())
    assert "| learner 1's process SIGKILLed at local step 5 | yes | 2.0 | 4.5 | — |" in md
    assert "| learner 0's process SIGKILLed at 9.5 s | no | did not fire |" in md
    assert "| 1 | SIGKILL | 3.0 | 2 | 7.5 | 4.5 | 2 | 2 | 1 |" in md
    assert report["setup"]["engine"] == "dask"
    assert report["setup"]["exchange"] == "fsspec (pretrain/diloco/exchange in the run directory)"


def _set_work_lost(run: Path, **work_lost) -> None:
    path = _layout(run).summary(PRE, "diloco")
    summary = json.loads(path.read_text())
    summary["work_lost"] = work_lost
    _write(path, summary)


def test_work_lost_at_the_top(run_dir: Path):
    # The fixture's ledger: 1,024 of 32,768 processed tokens dropped, all stale (3.1 %).
    base = {
        "processed_tokens": 32768,
        "dropped_tokens": 1024,
        "dropped_fraction": 1024 / 32768,
        "warn_above": 0.02,
        "fail_above": 0.03,
    }
    _set_work_lost(run_dir, **base, status="failed")
    report = build_report(run_dir)
    wl = _method(report)["work_lost"]
    assert wl["status"] == "failed" and wl["drop_reasons"] == {"stale": 1024}
    assert wl["drop_reason_fractions"] == {"stale": pytest.approx(1024 / 32768)}
    headline = (
        "**Warning: 3.1 % of DiLoCo's processed tokens (1,024 of 32,768) were dropped (stale 3.1 %); "
        "this run failed its diloco.max_dropped_fraction = 0.03 check (warning above "
        "diloco.warn_dropped_fraction = 0.02).**"
    )
    assert wl["headline"] == headline
    md = squash(_layout(run_dir).report_md.read_text())
    assert md.splitlines()[:3] == ["# Run report: tiny", "", headline]
    on_disk = json.loads((_layout(run_dir).report / "report.json").read_text())
    assert _method(on_disk)["work_lost"]["headline"] == headline
    assert (
        "**Work lost:** 1,024 of 32,768 processed tokens dropped (3.1 %: stale 3.1 %); warning above "
        "2.0 % (diloco.warn_dropped_fraction), run fails above 3.0 % (diloco.max_dropped_fraction); "
        "status: failed."
    ) in md

    # Warning; reasons from work_lost.reasons when the summary carries them.
    _set_work_lost(run_dir, **{**base, "fail_above": 0.5}, status="warning", reasons={"non-finite": 1000, "stale": 24})
    md = (build_report(run_dir), squash(_layout(run_dir).report_md.read_text()))[1]
    assert md.splitlines()[2] == (
        "**Warning: 3.1 % of DiLoCo's processed tokens (1,024 of 32,768) were dropped (non-finite 3.1 %, "
        "stale 0.1 %); above diloco.warn_dropped_fraction = 0.02; the run fails above "
        "diloco.max_dropped_fraction = 0.5.**"
    )
    # ok: nothing at the top, the line in the ledger section.
    _set_work_lost(run_dir, **{**base, "warn_above": 0.05, "fail_above": 0.5}, status="ok")
    report = build_report(run_dir)
    md = squash(_layout(run_dir).report_md.read_text())
    assert _method(report)["work_lost"]["headline"] is None and "**Warning" not in md and "status: ok." in md
    assert md.splitlines()[2].startswith("Decoupled DiLoCo (Douillard et al.")
    # Older runs without it: nothing computed, nothing shown.
    path = _layout(run_dir).summary(PRE, "diloco")
    summary = json.loads(path.read_text())
    summary.pop("work_lost")
    _write(path, summary)
    report = build_report(run_dir)
    assert _method(report)["work_lost"] is None and "Work lost" not in squash(_layout(run_dir).report_md.read_text())


def test_interrupted_pipeline_at_the_top(run_dir: Path):
    _write(
        _layout(run_dir).status,
        {"status": "interrupted", "completed_stages": ["data", "pretrain-diloco"], "reason": "SIGTERM"},
    )
    _set_work_lost(
        run_dir,
        processed_tokens=32768,
        dropped_tokens=32000,
        dropped_fraction=32000 / 32768,
        warn_above=0.05,
        fail_above=0.5,
        status="failed",
    )
    report = build_report(run_dir)
    assert report["pipeline"]["status"] == "interrupted"
    assert report["pipeline"]["completed_stages"] == ["data", "pretrain-diloco"]
    md = squash(_layout(run_dir).report_md.read_text()).splitlines()
    assert md[2] == (
        "**Interrupted: this run stopped before it finished (SIGTERM); completed stages: data, "
        "pretrain-diloco. Figures of the stages that did not complete are missing below.**"
    )
    assert md[4].startswith("**Warning: 97.7 % of DiLoCo's processed tokens")
    assert "- pipeline status: interrupted (completed stages: data, pretrain-diloco); reason: SIGTERM" in md
    # Completed: no bold line, the status in the header list.
    _write(_layout(run_dir).status, {"status": "completed", "completed_stages": ["data", "pretrain", "eval"]})
    report = build_report(run_dir)
    md = squash(_layout(run_dir).report_md.read_text())
    assert report["pipeline"]["headline"] is None and "**Interrupted" not in md
    assert "- pipeline status: completed (completed stages: data, pretrain, eval)" in md


def test_eval_extras(tmp_path: Path):
    run = _make_figures_run(tmp_path)
    report = build_report(run)
    md = squash(_layout(run).report_md.read_text())
    rows = [r["key"] for r in _stage(report)["comparison"] if r["group"] == "eval"]
    # Tasks come from the keys: the new heldout_cloze task appears without being named in the code.
    assert rows == ["heldout_nextline/acc", "heldout_cloze/acc", "truncated_requests", "eval_s"]
    acc = _row(report, "heldout_nextline/acc")
    assert acc["stderr"] == {"diloco": 0.035, "dp": 0.0351} and acc["chance"] == 0.25
    assert "| heldout_nextline: accuracy (fraction) | 0.412 ± 0.035 (chance 0.25) | 0.430 ± 0.035 (chance 0.25) |" in md
    assert "| heldout_cloze: accuracy (fraction) | 0.500 ± 0.050 (chance 0.2) | 0.550 ± 0.049 (chance 0.2) |" in md
    assert "| truncated requests (contexts cut to fit the window) (requests) | 7 | 0 |" in md
    # lm-eval's own results format: the stderr entries are kept ("N/A" ones dropped).
    _write(
        _layout(run).eval_result(PRE, "dp"),
        {
            "results": {
                "heldout_nextline": {
                    "alias": "heldout_nextline",
                    "acc,none": 0.43,
                    "acc_stderr,none": 0.0351,
                    "acc_norm,none": 0.44,
                    "acc_norm_stderr,none": "N/A",
                }
            },
            "eval_s": 2.5,
        },
    )
    report = build_report(run)
    assert _method(report, "dp")["eval"]["heldout_nextline/acc_stderr"] == 0.0351
    md = squash(_layout(run).report_md.read_text())
    assert "| heldout_nextline: accuracy (length-normalised) (fraction) | — | 0.440 (chance 0.25) |" in md


def test_a_running_status_reads_completing_only_when_the_pipeline_builds_the_report():
    from reports.analyses import pipeline_status

    raw = {"status": "running", "completed_stages": ["data", "pretrain-diloco"]}
    assert pipeline_status(raw, final_stage=True)["status"] == "completing"
    assert pipeline_status(raw)["status"] == "running"  # rebuilt by hand: running, or a dead process
    assert pipeline_status({"status": "completed", "completed_stages": []}, final_stage=True)["status"] == "completed"


def test_ledger_with_recomputed_tokens_balances_and_says_what_they_are():
    """A restarted learner's re-trained steps (``recomputed``: merged before, so not merged again) are
    their own ledger column, after merged; the balance check counts them: submitted = merged +
    recomputed + dropped + pending. A row that does not balance is still caught."""
    from reports.learners import ledger
    from reports.markdown import render

    summary = {
        "ledger": {
            "0": {
                "processed": 1000,
                "submitted": 900,
                "not_submitted": 100,
                "merged": 700,
                "recomputed": 150,
                "dropped": 50,
                "pending": 0,
                "drop_reasons": {"stale": 50},
                "attempts": 2,
            },
            "1": {
                "processed": 500,
                "submitted": 500,
                "not_submitted": 0,
                "merged": 400,
                "recomputed": 20,
                "dropped": 0,
                "pending": 0,
                "drop_reasons": {},
                "attempts": 2,
            },
        }
    }
    led = ledger(summary, fragments=2)
    assert led["columns"] == [
        "processed",
        "submitted",
        "not_submitted",
        "merged",
        "recomputed",
        "dropped",
        "pending",
        "attempts",
        "drop_reasons",
    ]
    assert led["total"]["recomputed"] == 170
    assert led["identity_violations"] == [
        {"learner": 1, "identity": "submitted = merged + recomputed + dropped + pending", "difference": 80}
    ]
    lines = render("ledger.md.j2", f={"ledger": led}, who="DiLoCo", unit="tokens").splitlines()
    (sentence,) = [line for line in lines if line.startswith("Tokens per learner:")]
    assert "recomputed = " in sentence and "submitted = merged + recomputed + dropped + pending hold" in sentence
    assert "| 0 | 1,000 | 900 | 100 | 700 | 150 | 50 | 0 | 2 | stale: 50 | 70.0 |" in squash("\n".join(lines))


def test_a_recomputed_copy_is_not_a_dropped_submission():
    """The syncer drops a restarted learner's copy of steps already merged as "recomputed": that is
    re-done work (the ledger's recomputed column), not a submission the learner lost."""
    from reports.learners import learner_table

    events = [
        {"event": "start", "learner": 0, "t": 0.0},
        {"event": "dropped", "learner": 0, "reason": "recomputed", "t": 1.0},
        {"event": "dropped", "learner": 0, "reason": "stale", "t": 2.0},
    ]
    (row,) = learner_table(events)
    assert row["dropped_submissions"] == 1 and row["starts"] == 1


def test_the_headline_gap_is_on_the_test_split_when_both_methods_were_measured_there(tmp_path):
    """Summaries with ``heldout`` (whole val and test splits after training): the table shows both, the
    curves' validation sample is labelled as such, and the loss gap is the test split's."""
    run = _make_run(tmp_path)
    lay = _layout(run)
    for m, (val, test) in {"diloco": (3.32, 3.41), "dp": (3.05, 3.10)}.items():
        summary = json.loads(lay.summary(PRE, m).read_text())
        summary["heldout"] = {
            "val": {"loss": val, "rows": 96, "units": 6144},
            "test": {"loss": test, "rows": 88, "units": 5632},
        }
        lay.summary(PRE, m).write_text(json.dumps(summary))
    report = build_report(run)
    gap = report["stages"][PRE]["loss_gaps"]["diloco"]
    assert gap["split"] == "test" and gap["gap_pct"] == pytest.approx(100 * (3.41 - 3.10) / 3.10)
    assert _row(report, "test_loss")["dp"] == 3.10 and _row(report, "val_loss_whole")["diloco"] == 3.32
    md = squash(lay.report_md.read_text())
    assert "| final test loss (the whole test split: nothing tuned on it) (nats/token) | 3.4100 | 3.1000 |" in md
    assert "final test loss (the whole test split) is +10.00% relative to" in md


def test_the_data_section_shows_unset_values_and_shards_in_words():
    """The manifest's rows (the report's Data section): an unset value reads ``(none)`` and a list of
    shards their names, never Python's ``None`` or a dict (a fresh user found both); a recorded
    config value the manifest states at its top level too appears once."""
    from reports.analyses import manifest_items

    shards = [{"name": f"shard_0{i}", "path": f"data/shard_0{i}", "tokens": 384768} for i in range(4)]
    config = {"data": {"hf_name": None, "paths": [], "seq_len": 128, "vocab_size": 2048}, "learners": 4}
    manifest = {"config": config, "seq_len": 128, "vocab_size": 1990, "learners": 4, "shards": shards}
    rows = dict(manifest_items(manifest))
    assert rows == {
        "config/data/hf_name": "(none)",
        "config/data/paths": "(none)",
        "config/data/vocab_size": "2,048",  # asked for 2,048, trained 1,990: both shown
        "seq_len": "128",
        "vocab_size": "1,990",
        "learners": "4",
        "shards": "shard_00, shard_01, shard_02, shard_03",
    }
