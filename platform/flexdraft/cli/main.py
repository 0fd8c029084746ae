"""`flexdraft` command line: one module per command group (generate, bench, train, drafters, serve, cluster, env, demo);
this one builds the parser from their `register`s and runs the chosen command."""
from __future__ import annotations

import argparse
import os
import sys

from flexdraft.cli import bench, cluster, console, demo_cmd, drafters, env, generate, serve, train
from flexdraft.core import logs
from flexdraft.core.errors import FlexDraftError

GROUPS = (generate, bench, train, drafters, cluster, env, serve, demo_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexdraft", description=__doc__.split(";")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if console.wanted(args):
        return console.run_quiet(sys.argv[1:] if argv is None else argv, args.command)
    logs.setup()
    try:
        args.func(args)
    except FlexDraftError as e:
        print(f"flexdraft: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`flexdraft drafters list | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush does not fail again)
        return 0
    except KeyboardInterrupt:  # what a command started is stopped by its own `finally`s first
        print(f"flexdraft {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
