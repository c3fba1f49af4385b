"""The run report: every method of every stage side by side, each against the data-parallel baseline.

Decoupled DiLoCo: Douillard et al., "Decoupled DiLoCo for Resilient Distributed Pre-training",
arXiv 2604.21428 (2026).

Everything is read back from one run directory through ``run.layout.RunLayout``; nothing depends
on the in-memory state of an earlier flow, so a report can be rebuilt for any finished (or
half-finished) run::

    from reports import build_report
    report = build_report("runs/default-20261129-101500")

:func:`build_report` writes ``RUN/report/``:

``report.md``
    The human report: header (run name, date, git commit, package versions), right under the
    title a bold line when the pipeline was interrupted or failed (``status.json``) and when a
    method's lost work crossed a threshold (``work_lost`` in its summary); the setup; then one
    section per stage (``pretrain``, ``finetune``): the side-by-side table of its methods and each
    method's loss gap to DP, the lm-eval table ("0.412 ± 0.035 (chance 0.25)", truncated
    requests), the bytes on the wire (each byte figure named by what it counts and who counts it),
    the loss curves, hyperparameters and, for each learners-and-syncer method (DiLoCo), its token
    ledger and lost work, the scheduled chaos events and whether each fired, learner failures and
    the merges that happened while a learner was down; then *Post-training* when the run
    fine-tuned its pretrained models (``reports.finetune``): the task, the recipe, per task metric
    each method's score pretrained → fine-tuned (95 % bootstrap intervals over test items and
    seeds), the DiLoCo − DP difference with its paired two-level bootstrap interval and a parity
    verdict, the pretraining tasks before → after, the runs and the loss figure; last the data
    manifest. A ``finetune`` stage written by the fine-tuning recipe (``recipe``/``runs`` in its
    summaries, per-item task scores in ``eval/finetune/``) is reported there, not as a
    pretraining-style stage section.
``report.json``
    Every number shown in ``report.md``, machine-readable; ``json.loads`` of the file equals the
    dict that :func:`build_report` returns.
``<stage>_loss_vs_tokens.png``
    Held-out loss (mean next-token cross entropy, **nats/token**) against training **tokens**
    consumed (DiLoCo: summed over all learners), every method of the stage on one axes, final
    values annotated.
``<stage>_loss_vs_time.png``
    The same held-out loss against wall-clock **seconds** since the method's training started.
``pretrain_loss_vs_modelled_time.png``
    The same held-out loss against **modelled seconds** under the config's ``network`` (each worker
    on its own host, the links of ``network``: ``reports.interconnect``), its assumption in the
    title; not drawn for a same-host network (``network.bandwidth_gbps`` null).
``finetune_loss.png`` (post-training)
    Fine-tuning loss against fine-tuning step, every method on one axes in its colour: training
    loss per seed (thin) and the loss on the task's held-out test items (markers).
``<stage>_<method>_merges_over_time.png`` (a method with merges)
    One marker per merge of a fragment (y: fragment index, x: seconds since training start, colour:
    number of contributing learners); learner failures (red) and restarts (green) as vertical
    lines, the downtime shaded.

Units: tokens (BPE tokens), seconds (wall clock), bytes (payload bytes, see
``reports.common.BYTES_CONVENTION`` for who counts what), nats (natural-log cross entropy;
perplexity = exp(loss)). Every figure is computed once (``reports.analyses``,
``reports.learners``, ``reports.finetune``) from one named source (the contract's field names, docs/contracts.md);
every place of ``report.md`` that shows it reads that one value (``reports.markdown`` computes
nothing).

Missing inputs inside a run directory are normal (DP disabled, eval disabled, no failures): the
part they feed says "not run". Results the run's record says exist but are gone (a summary of a
method that ``status.json`` lists as completed, or of a completed run's method that holds metrics or
checkpoints: ``reports.read.missing_results``) raise :class:`ReportInputError` naming the file, before
``report/`` is touched, rather than reading "not run". A path that does not exist, or a folder with neither
``config.json`` nor a stage holding a method, raises :class:`ReportInputError` naming the path
(and nothing is written there); a file that exists but is not valid JSON raises it naming the file.

Modules: ``read`` (the run directory, through ``RunLayout``), ``analyses``, ``learners`` and
``finetune`` (pure figures; ``finetune`` also holds the paired bootstrap), ``plots`` (matplotlib;
also the style of ``sim.plot``), ``markdown`` (rendering), ``build`` (:func:`build_report`) and
``artifacts`` (Prefect artifacts, the only Prefect import of the report:
``from reports.artifacts import publish_report_artifacts``).
"""

from reports.build import build_report
from reports.read import ReportInputError

__all__ = ["ReportInputError", "build_report"]
