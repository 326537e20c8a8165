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


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of `only` (one of COMMANDS): each subcommand's
    module is imported to add its arguments, and a start that runs one command need not
    import the others (serve's and bench's imports cost a warm start tens of ms)."""
    parser = argparse.ArgumentParser(prog="jetserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        if only is not None and name != only:
            continue
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The command is the first argument when it names one; otherwise (--help, a typo) the
    # whole parser answers, listing every command.
    only = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(only).parse_args(argv)
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
