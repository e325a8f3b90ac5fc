"""What every subcommand shares: exit codes, and the config arguments and how they are read."""

from __future__ import annotations

import argparse

from nanotron_ext.config import PlannerConfig, bundled_config, load_config
from nanotron_ext.strategies import available_strategies

__all__ = ["EXIT_INVALID", "EXIT_OK", "EXIT_USAGE", "add_config_args", "config_from_args"]

#: 0: done, the plan can train; 1: the plan cannot train, or the run failed; 2: bad usage or config.
EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def add_config_args(p: argparse.ArgumentParser, *, positional: bool = True) -> None:
    """The config file (positional, optional) and the ``--cost-strategy`` and ``--pp`` overrides."""
    if positional:
        p.add_argument("config", nargs="?", help="Nanotron YAML (default: the bundled tiny large-vocab example)")
    p.add_argument("--cost-strategy", dest="cost_strategy", metavar="NAME",
                   help=f"overrides the YAML; one of {', '.join(available_strategies())} or package.module:attr")
    p.add_argument("--pp", type=int, help="overrides parallelism.pp")


def config_from_args(args: argparse.Namespace, path: str | None) -> PlannerConfig:
    """The config at ``path`` (the bundled example when None) with the command line's overrides."""
    return load_config(path or bundled_config(), cost_strategy=args.cost_strategy, pp=args.pp)
