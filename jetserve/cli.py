"""The `jetserve` command: one module per subcommand under jetserve/commands/."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand -> module (explicit registry). Each module has add_arguments(p) and run(args).
COMMANDS = {
    "generate": "jetserve.commands.generate",
    "convert": "jetserve.commands.convert",
    "serve": "jetserve.commands.serve",
    "shard-report": "jetserve.commands.shard_report",
    "plan": "jetserve.commands.plan",
    "bench": "jetserve.commands.bench",
    "batch": "jetserve.commands.batch",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "compile_cache"):  # a command that builds an engine
            from jetserve import compile_cache

            compile_cache.enable(args.compile_cache)  # before its first compile
        return int(args._module.run(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"jetserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
