"""Batch jobs: JSONL rows in, JSONL results out, resumable, on one host or many.

rows.py (an input row -> a job), wellformed.py (text and nesting a row may not hold),
inputs.py (reading the input; who runs which row), journal.py (the durable output),
recovery.py (reading it back to resume: torn tail, verification, --repair), durable.py
(writes that fail cleanly), preflight.py (checks before the model loads), results.py
(output rows), runner.py (a job's bookkeeping and order), orchestrated.py (an
orchestrator at full occupancy: the threaded one, or the lock-step one of a model shared
by several processes), merge.py (joining the parts of an independent multi-process run);
on a Ray cluster (the `ray` extra): ray_job.py (the driver: the dataset, the one writer),
ray_actor.py (an engine actor), ray_ledger.py (what survives an actor's death).
The command is jetserve/commands/batch.py.
"""
