"""``nanotron-ext train``: train a Nanotron YAML's model on CPU through Nanotron 0.2's real pipeline engines.

Launch one process per rank (``dp × pp × tp`` of them) with torchrun::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 -m nanotron_ext.cli train \\
        --config-file nanotron_ext/configs/tiny_llama_large_vocab.yaml --steps 20

(``torchrun --nproc_per_node=2 --no-python nanotron-ext train ...`` runs the console script instead; a
one-process config, ``dp = pp = tp = 1``, also runs without torchrun.) Any error is
``nanotron-ext train: error on rank R: <message>``, printed once a job and written to each rank's torchelastic error
file (:func:`~nanotron_ext.cli.failure.report_rank_error`); the rank exits with the code of
:mod:`nanotron_ext.cli.failure` (1 the plan cannot train, 2 config/usage, 3 runtime failure). Under torchrun a
rank dies with its launcher; a silent peer fails the run after ``$NANOTRON_EXT_TIMEOUT_S`` seconds (default
60). The loop itself is :mod:`nanotron_ext.runtime.train`.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

from nanotron_ext.cli.common import EXIT_OK, check_outputs, non_negative_int, positive_int, report_rank_error
from nanotron_ext.config import bundled_config
from nanotron_ext.config_keys import DuplicateKeyWarning, UnreadKeyWarning
from nanotron_ext.devices import DEVICE_ENV, DEVICE_TYPES, use_device

__all__ = ["REPEATED_WARNINGS", "add_subcommand", "cmd_train", "quiet_repeated_warnings"]

#: Warnings every rank raises alike: about code the user does not own (torch's and Nanotron's deprecations, such as
#: torch's "`torch.distributed.all_reduce_coalesced` will be deprecated", which Nanotron 0.2 calls) and about the
#: config file every rank reads. Rank 0 prints each once, the other ranks none: a warning is printed at most once.
REPEATED_WARNINGS: tuple[type[Warning], ...] = (
    FutureWarning,
    DeprecationWarning,
    UnreadKeyWarning,
    DuplicateKeyWarning,
)


def add_subcommand(subparsers: Any) -> None:
    """Register ``train`` on the ``nanotron-ext`` parser."""
    p = subparsers.add_parser(
        "train",
        help="train on CPU through Nanotron's pipeline engines (run under torchrun)",
        description="Train a Nanotron YAML's Llama on CPU (gloo) with Nanotron 0.2's 1F1B/AFAB engines. Run "
        "under `torchrun --nproc_per_node=<dp*pp*tp> -m nanotron_ext.cli train ...`.",
    )
    p.add_argument(
        "--config-file",
        dest="config_file",
        metavar="YAML",
        help="Nanotron YAML (default: the bundled tiny large-vocab example)",
    )
    p.add_argument("--cost-strategy", dest="cost_strategy", metavar="NAME", help="overrides the YAML's strategy")
    p.add_argument("--steps", type=positive_int, metavar="N", help="training steps (default: tokens.train_steps)")
    p.add_argument(
        "--seed", type=non_negative_int, metavar="S", help="overrides general.seed (weights) and data.seed (data order)"
    )
    p.add_argument("--metrics-out", dest="metrics_out", metavar="FILE.json", help="write metrics JSON (rank 0)")
    p.add_argument("--plan-out", dest="plan_out", metavar="FILE.json", help="write the plan as JSON (rank 0)")
    p.add_argument(
        "--replan-after",
        dest="replan_after",
        metavar="K",
        help="after step K, price the run from its own steps, plan again under the same memory and move "
        "to the faster plan (nanotron_ext.replan.after_steps; docs/replan.md)",
    )
    p.add_argument(
        "--device",
        choices=DEVICE_TYPES,
        default=None,
        help=f"where to train (default: ${DEVICE_ENV}, else cuda when torch sees a GPU, else cpu; the rule "
        "calibrate follows too)",
    )
    p.set_defaults(func=cmd_train)


def quiet_repeated_warnings(rank: str) -> None:
    """On every rank but 0, ignore :data:`REPEATED_WARNINGS` (rank 0 prints them, once each)."""
    if rank != "0":
        for category in REPEATED_WARNINGS:
            warnings.filterwarnings("ignore", category=category)


def cmd_train(args: argparse.Namespace) -> int:
    """Run :func:`run_training` from parsed arguments; print any error with this rank's number.

    Returns:
        The exit code of :mod:`nanotron_ext.cli.failure`: 0 trained, 1 the plan cannot train, 2 a config or
        usage error (output paths are checked before anything runs), 3 a runtime failure (a peer rank died
        or stopped answering for ``$NANOTRON_EXT_TIMEOUT_S`` seconds).
    """
    rank = os.environ.get("RANK", "0")
    quiet_repeated_warnings(rank)
    try:
        from nanotron_ext.procs import exit_with_torchrun

        exit_with_torchrun()
        use_device(args.device)
        check_outputs((args.metrics_out, "--metrics-out"), (args.plan_out, "--plan-out"))
        from nanotron_ext.runtime.train import run_training  # imports torch and nanotron: only when training

        run_training(
            args.config_file or bundled_config(),
            cost_strategy=args.cost_strategy,
            steps=args.steps,
            seed=args.seed,
            metrics_out=args.metrics_out,
            plan_out=args.plan_out,
            replan_after=args.replan_after,
        )
    except Exception as exc:  # every failure must end this rank with one message, never a hang
        return report_rank_error(exc, f"nanotron-ext train: error on rank {rank}: ", tag=False)
    return EXIT_OK
