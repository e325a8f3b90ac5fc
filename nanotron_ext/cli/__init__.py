"""``nanotron-ext`` command line: one module per subcommand.

* ``nanotron-ext plan [CONFIG] [--cost-strategy NAME] [--pp N] [--compare] [--json]`` — dry run: no GPU,
  no process group.
* ``nanotron-ext train --config-file X.yaml`` — CPU training on Nanotron's engine (under ``torchrun``).
* ``nanotron-ext simulate CONFIG --out timeline.png`` — bubble-time simulation and pictures.
* ``nanotron-ext calibrate CONFIG --out machine.json`` — measure this machine (its links: under ``torchrun``) into
  the profile ``plan``/``simulate --machine`` read.

Exit codes (:mod:`nanotron_ext.cli.failure`): 0 OK, 1 the plan cannot train, 2 bad usage or config, 3 a
runtime failure, 141 the reader of the output closed it before the command could write it, quietly
(:mod:`nanotron_ext.cli.output`).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from nanotron_ext.cli import calibrate, plan, simulate, train
from nanotron_ext.cli.common import EXIT_CLOSED_PIPE, EXIT_RUNTIME, Parser, report_error, version_line
from nanotron_ext.cli.output import WholeOutput, drop_output, whole_output

__all__ = ["DESCRIPTION", "FIRST_STEPS", "build_parser", "main"]

#: What the tool does, the first lines of ``nanotron-ext --help``.
DESCRIPTION = """\
Plan which blocks of a Nanotron model go to which pipeline stage, check before any
weight exists that every stage can train and fits its GPU, and price the training
step on a machine you can measure."""
#: The end of ``nanotron-ext --help``: what a newcomer runs first, the exit codes, where the docs are.
FIRST_STEPS = """\
first steps:
  nanotron-ext plan                    the bundled example (a tiny Llama, pp=2): split, memory, verdict
  nanotron-ext plan CONFIG --compare   every strategy side by side on your Nanotron YAML
  nanotron-ext simulate CONFIG         one simulated training step, drawn to timeline.png
  nanotron-ext COMMAND --help          the flags of one command

exit codes: 0 the plan can train, 1 it cannot, 2 bad usage or config, 3 a runtime
failure, 141 the reader closed the output before it was written.
docs: docs/cli.md (every command, flag and column), then README.md and docs/."""


def build_parser() -> argparse.ArgumentParser:
    """The ``nanotron-ext`` parser with every subcommand."""
    parser = Parser(prog="nanotron-ext", description=DESCRIPTION, epilog=FIRST_STEPS, formatter_class=_KeepLayout)
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    plan.add_subcommand(sub)
    train.add_subcommand(sub)
    simulate.add_subcommand(sub)
    calibrate.add_subcommand(sub)
    return parser


class _KeepLayout(argparse.RawDescriptionHelpFormatter):
    """The description and the first steps as written; each command's line starts where the longest name ends."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog)
        # argparse measures a command's name without its indent, so "calibrate" would get a line of its own.
        self._action_max_length = len("    calibrate")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    try:
        with whole_output() as output:  # --help and --version too: one rule for a reader that leaves
            return _run(argv, output)
    except BrokenPipeError:  # the reader left before the output was written
        drop_output()
        return EXIT_CLOSED_PIPE
    except OSError as exc:  # the output could not be written at all (a full disk)
        drop_output()
        print(
            f"nanotron-ext: error: cannot write the output: {exc.strerror or exc}; free space or write elsewhere",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_RUNTIME


def _run(argv: Sequence[str] | None, output: WholeOutput) -> int:
    args = build_parser().parse_args(argv)
    if not getattr(args, "whole_output", False):  # train and calibrate stream their progress
        output.release()
    warnings.formatwarning = _one_line_warning
    try:
        return int(args.func(args))
    except Exception as exc:  # one message and the documented exit code (cli.failure; 141 for a reader that left)
        return report_error(exc)


def _one_line_warning(message: Warning | str, category: type[Warning], *_: object, **__: object) -> str:
    return f"nanotron-ext: warning: {message}\n"
