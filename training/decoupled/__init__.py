"""A Decoupled DiLoCo run from plain inputs (the algorithm itself is ``diloco/``; no Prefect here):
``setup`` (the exchange, the syncer's and each learner's set-up), ``syncer`` (the syncer's loop and
the stage's summary) and ``monitor`` (the flow's view of a running stage).

Both methods see the same data (the DP job reads the union of the learner shards), the same token
budget (``cfg.dp_steps × tokens per DP step``) and the same validation batches.
"""

STAGE, METHOD = "pretrain", "diloco"
