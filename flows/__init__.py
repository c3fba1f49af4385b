"""Prefect flows of the pipeline (shard → pretrain → evaluate → fine-tune → report), sweeps and goodput."""

import logging


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a flow or task run, else the ``flows`` logger."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("flows")
