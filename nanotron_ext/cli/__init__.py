"""``nanotron-ext`` command line: one module per subcommand.

* ``nanotron-ext plan [CONFIG] [--cost-strategy NAME] [--pp N] [--compare] [--json]`` — dry run: no GPU,
  no process group.
* ``nanotron-ext train --config-file X.yaml`` — CPU training on Nanotron's engine (under ``torchrun``).
* ``nanotron-ext simulate CONFIG --out timeline.png`` — bubble-time simulation and pictures.
* ``nanotron-ext calibrate CONFIG --out machine.json`` — measure this machine (its links: under ``torchrun``) into
  the profile ``plan``/``simulate --machine`` read.

Exit codes (:mod:`nanotron_ext.cli.common`): 0 OK, 1 the plan cannot train, 2 bad usage or config, 3 a
runtime failure, 141 the reader of the output closed it early (``nanotron-ext plan | head -2``), quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence

from nanotron_ext.cli import calibrate, plan, simulate, train
from nanotron_ext.cli.common import EXIT_CLOSED_PIPE, Parser, report_error, version_line

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``nanotron-ext`` parser with every subcommand."""
    parser = Parser(prog="nanotron-ext", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True)
    plan.add_subcommand(sub)
    train.add_subcommand(sub)
    simulate.add_subcommand(sub)
    calibrate.add_subcommand(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # --help and --version exit through here too; a closed pipe shows now, not at exit
    except BrokenPipeError:
        return _closed_pipe()


def _run(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    warnings.formatwarning = _one_line_warning
    try:
        return int(args.func(args))
    except BrokenPipeError:
        raise  # the reader left: main ends quietly
    except Exception as exc:  # one message and the documented exit code (cli.common), never a traceback
        return report_error(exc)


def _closed_pipe() -> int:
    """The reader closed our output (``| head``): stop quietly, as a Unix tool killed by SIGPIPE does."""
    # Whatever is still buffered would fail again when the interpreter flushes stdout on exit.
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file (a test's capture): nothing will flush it at exit
        pass
    finally:
        os.close(devnull)
    return EXIT_CLOSED_PIPE


def _one_line_warning(message: Warning | str, category: type[Warning], *_: object, **__: object) -> str:
    return f"nanotron-ext: warning: {message}\n"
