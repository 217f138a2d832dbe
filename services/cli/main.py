"""`stagemesh` command line: one parser, subcommands registered by the module that implements them."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from shared.errors import StagemeshError


class CommandParser(argparse.ArgumentParser):
    """A parser that takes flags only as written: `--stage 3` is an error, never `--stages 3` by abbreviation."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """Every command's flags, from modules that import nothing heavy: each command's own module is imported when it
    runs (services.process.args.later)."""
    parser = CommandParser(prog="stagemesh", description="Serve a GGUF model as a mesh of pipeline stages.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    for module in ("services.cli.flags", "services.cli.join", "services.stage.flags", "services.gateway.flags", "services.process.keys",
                   "services.cli.status", "loadtest.cli"):
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except StagemeshError as e:  # a flag default from the environment that is not valid (STAGEMESH_*)
        print(f"stagemesh: error: {e}", file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, with its usage (not the top level's)
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if hasattr(args, "kernel_plan"):  # a command that loads a model: its kernel plans, chosen once, here
        from shared.kernels import plans

        plans.use(plans.KernelPlans.from_flag(args.kernel_plan))
    try:
        return int(args.func(args) or 0)
    except StagemeshError as e:
        print(f"stagemesh {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
