"""Logical axis names used by model code. Presets map them to mesh axes."""

BATCH = "batch"
SEQ = "seq"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
EXPERT = "expert"
CACHE_BATCH = "cache_batch"
CACHE_SEQ = "cache_seq"
CACHE_HEADS = "cache_heads"
# The leading axis of parameters stacked over layers (a scanned decoder, engines/layer_scan.py);
# presets leave it unsplit.
LAYERS = "layers"

ALL = (BATCH, SEQ, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, EXPERT,
       CACHE_BATCH, CACHE_SEQ, CACHE_HEADS, LAYERS)
