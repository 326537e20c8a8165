"""`jetserve bench`: benchmark programs that print figures (never timed tests).

One module per benchmark: bandwidth (machine probes), decode (step time against the
memory / compute floor), compare_hf (jetserve against transformers on the same weights),
hf_model (random HF checkpoints for those comparisons).
"""
