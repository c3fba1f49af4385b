"""Where learners and the syncer run: Prefect task runners on threads, Ray or Dask."""
