"""The run directory and the life of a run: where it lives, what state it is in, and how it stops.

No Prefect and no JAX here: everything in this package runs before either starts.
"""
