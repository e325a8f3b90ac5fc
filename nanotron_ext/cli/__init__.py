"""``nanotron-ext`` command line: one module per subcommand.

* ``nanotron-ext plan [CONFIG] [--cost-strategy NAME] [--pp N] [--compare] [--json]`` — dry run: no GPU,
  no process group. Exit 0 when the plan is valid, 1 when it has errors, 2 on usage errors.
* ``nanotron-ext train --config-file X.yaml`` — CPU training on Nanotron's engine (under ``torchrun``).
* ``nanotron-ext simulate CONFIG --out timeline.png`` — bubble-time simulation and pictures.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from nanotron_ext.cli import plan, simulate, train
from nanotron_ext.cli.common import EXIT_INVALID, EXIT_USAGE
from nanotron_ext.errors import ConfigError, NanotronExtError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``nanotron-ext`` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="nanotron-ext", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan.add_subcommand(sub)
    train.add_subcommand(sub)
    simulate.add_subcommand(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"nanotron-ext: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NanotronExtError as exc:
        print(f"nanotron-ext: {exc}", file=sys.stderr)
        return EXIT_INVALID
