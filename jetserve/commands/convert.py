"""Convert a Hugging Face safetensors model directory into a jetserve Orbax checkpoint."""

from __future__ import annotations

import argparse

from jetserve.model_loading import build_engine
from engines.checkpoint import save_orbax


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-hf", required=True, help="HF model directory")
    p.add_argument("--to", required=True, help="output directory")


def run(args: argparse.Namespace) -> int:
    engine = build_engine(args.from_hf)
    params = engine.load_params()
    save_orbax(params, engine.model_config, args.to, args.from_hf)
    print(f"wrote {args.to}")
    return 0
