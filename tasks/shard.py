"""The data step as a Prefect task (the plain code is ``data.prepare.prepare_data``)."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from data.prepare import prepare_data

shard_data_task = task(
    name="shard-data",
    cache_policy=NO_CACHE,
    log_prints=False,  # datasets prints bytecode while fingerprinting; keep it out of the run log
    description=(
        "Text: corpus → held-out split → BPE → packed sequences; images: stratified split; "
        "then M learner shards (RUN/data)"
    ),
)(prepare_data)
