"""Convert a Hugging Face safetensors model directory into a jetserve Orbax checkpoint.

With --quantize the checkpoint holds int8 or int4 weights (engines/quantization.py), and
every command loads it quantized.
"""

from __future__ import annotations

import argparse

from engines import EngineConfig
from engines.checkpoint import save_orbax
from jetserve.commands.common import add_quantize_arguments
from jetserve.model_loading import build_engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-hf", required=True, help="HF model directory")
    p.add_argument("--to", required=True, help="output directory")
    add_quantize_arguments(p)


def run(args: argparse.Namespace) -> int:
    engine = build_engine(args.from_hf, engine_config=EngineConfig(
        quantize=args.quantize, quant_group_size=args.quant_group_size))
    params = engine.load_params()
    # As stored: one copy of each kv head, whatever the engine's layout repeats.
    save_orbax(engine.checkpoint_params(params), engine.source_config, args.to, args.from_hf)
    print(f"wrote {args.to}")
    return 0
