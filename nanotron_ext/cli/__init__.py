"""``nanotron-ext`` command line: one module per subcommand.

* ``nanotron-ext plan [CONFIG] [--cost-strategy NAME] [--pp N] [--compare] [--json]`` — dry run: no GPU,
  no process group.
* ``nanotron-ext train --config-file X.yaml`` — CPU training on Nanotron's engine (under ``torchrun``).
* ``nanotron-ext simulate CONFIG --out timeline.png`` — bubble-time simulation and pictures.
* ``nanotron-ext calibrate CONFIG --out machine.json`` — measure this machine (its links: under ``torchrun``) into
  the profile ``plan``/``simulate --machine`` read.

Exit codes (:mod:`nanotron_ext.cli.common`): 0 OK, 1 the plan cannot train, 2 bad usage or config, 3 a
runtime failure.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence

from nanotron_ext.cli import calibrate, plan, simulate, train
from nanotron_ext.cli.common import report_error

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``nanotron-ext`` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="nanotron-ext", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan.add_subcommand(sub)
    train.add_subcommand(sub)
    simulate.add_subcommand(sub)
    calibrate.add_subcommand(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    warnings.formatwarning = _one_line_warning
    try:
        return int(args.func(args))
    except Exception as exc:  # one message and the documented exit code (cli.common), never a traceback
        return report_error(exc)


def _one_line_warning(message: Warning | str, category: type[Warning], *_: object, **__: object) -> str:
    return f"nanotron-ext: warning: {message}\n"
