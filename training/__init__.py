"""Training, written once for every model kind and method: the pure step, optimizers, evaluation
cadence, checkpoints, the DP loop and the DiLoCo run setup. No Prefect here (``tasks/`` wraps it)."""
