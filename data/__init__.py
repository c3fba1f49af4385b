"""Data preparation and reading, no Prefect: sources → text preparation → run-directory data → batches.

``data.sources`` (corpora and their checks), ``data.text`` (``prepare_data``: split, tokenizer,
packing, shards), ``data.store`` (reading ``RUN/data`` back), ``data.cursor`` (``batch_at``: resumable
batches), ``data.images`` (image sources, stratified split, shards) and ``data.prepare`` (the step
for either modality, ``load_rows``).
"""
