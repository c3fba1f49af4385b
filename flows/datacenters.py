"""A pretraining stage across emulated datacenters (``network.emulate``; ``run.netem``).

For the stage's block, :func:`emulated` makes one datacenter per DiLoCo learner (or per DP host),
each a network namespace joined to this one, the hub's, by a link shaped to
``network.bandwidth_gbps`` each way (unshaped when null). DiLoCo's syncer stays in this process and
its exchange moves to an S3-compatible server started on the hub's address (``run.s3_server``):
every fragment, heartbeat and published Θ of a learner process crosses its datacenter's link. DP's
hosts start in their datacenters (``training.dp_job.run_agent``), so its all-reduce crosses them too.
When the block ends the datacenters are removed (a reaper does it if this process dies), and the
bytes each link carried, counted by the kernel, go into ``pretrain/<method>/network/network.json``
and the stage's summary (``network``). Latency is not emulated (no netem in this kernel).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from configs.schema import ExperimentConfig
from run.atomic import write_json
from run.layout import NetworkFolder, RunLayout

BUCKET = "ddiloco"
CREDENTIALS = ("emulated", "emulated")  # the hub's store accepts any; a key the clients can send


@contextlib.contextmanager
def emulated(config: ExperimentConfig, rd: Path, method: str) -> Iterator[ExperimentConfig]:
    """The config of pretraining stage ``method`` (diloco or dp) for the block, with its datacenters
    (module docstring) where ``network.emulate``. Raises ``RuntimeError`` when they cannot be made here."""
    if not config.network.emulate:
        yield config
        return
    from run.netem import datacenters, emulation_problem

    problem = emulation_problem()
    if problem:
        raise RuntimeError(problem)
    layout = RunLayout(rd)
    net = NetworkFolder(layout.network("pretrain", method))
    net.root.mkdir(parents=True, exist_ok=True)
    count = config.diloco.learners if method == "diloco" else config.dp.hosts
    with datacenters(count, config.network.bandwidth_gbps) as dcs, contextlib.ExitStack() as stack:
        stage = config
        if method == "diloco":
            from run.s3_server import S3Server

            s3 = stack.enter_context(S3Server(log=net.store_log, host=dcs.hub, credentials=CREDENTIALS))
            stack.enter_context(mock.patch.dict(os.environ, s3.env))
            s3.create_bucket(BUCKET)
            raw = config.model_dump(mode="json")
            raw["runtime"] = {**raw["runtime"], "exchange": "fsspec", "exchange_url": f"s3://{BUCKET}/{rd.name}"}
            stage = ExperimentConfig.model_validate_json(json.dumps(raw), context={"stored": True})
            net.config.write_text(stage.model_dump_json())
        dcs.save(net.datacenters)
        before = dcs.link_bytes()
        try:
            yield stage
        finally:
            after = dcs.link_bytes()
            links = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
            record = {**dcs.describe(), "links": links, "sent_bytes": sum(x["sent"] for x in links)}
            record["received_bytes"] = sum(x["received"] for x in links)
            if method == "diloco":
                record["store"] = f"moto S3 server on the hub ({s3.endpoint})"
            write_json(net.record, record)
            summary = layout.summary("pretrain", method)
            if Path(summary).exists():
                write_json(summary, {**json.loads(Path(summary).read_text()), "network": record})
