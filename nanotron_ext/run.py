"""``python -m nanotron_ext.run [--cost-strategy NAME] SCRIPT [ARGS...]``: run an unchanged Nanotron training
script with the planned split, freezing and the every-rank check. Put it where the script would go::

    torchrun --nproc_per_node=8 -m nanotron_ext.run run_train.py --config-file config.yaml

``--cpu-debug`` runs the same trainer on CPU over gloo with the stand-ins of
:mod:`nanotron_ext.integration.cpu_standins`, to debug a split, a checkpoint or a resume on a laptop (not for speed).

The config file is the script's own ``--config-file`` (or this module's ``--config-file``): our keys stay in
it and are stripped before Nanotron's loader reads it. What is installed is described in
:mod:`nanotron_ext.integration.trainer_patches`.
"""

from __future__ import annotations

import argparse
import gc
import os
import runpy
import sys
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanotron_ext.checkpoint import ResumeSource, check_same_model, kept_vocab_shards, locate_checkpoint
from nanotron_ext.checkpoint.resume import launch_engine
from nanotron_ext.cli.common import EXIT_OK, Parser, report_rank_error
from nanotron_ext.config import PlannerConfig, load_config
from nanotron_ext.config_keys import installed_nanotron_keys
from nanotron_ext.errors import ConfigError, NanotronExtError
from nanotron_ext.integration.cpu_standins import FLAG as CPU_DEBUG_FLAG
from nanotron_ext.plan import resolve_vocab_shards
from nanotron_ext.plan.replan import with_replan_after
from nanotron_ext.procs import exit_with_torchrun, exit_without_teardown
from nanotron_ext.strategies import get_strategy

if TYPE_CHECKING:
    from nanotron_ext.integration.replan import LauncherReplan

__all__ = ["config_file_of", "main"]

_CONFIG_FLAGS = ("--config-file", "--config_file", "--config")


def config_file_of(script_args: list[str]) -> str | None:
    """The value of the script's ``--config-file`` (also ``--config_file``, ``--config``), or None."""
    for i, arg in enumerate(script_args):
        for flag in _CONFIG_FLAGS:
            if arg == flag and i + 1 < len(script_args):
                return script_args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m nanotron_ext.run",
        description="Run a Nanotron training script (e.g. run_train.py) with nanotron_ext's plan, freezing and "
        "gradient check. Start it with torchrun where the script would go.",
    )
    parser.add_argument("--cost-strategy", default=None, help="overrides the YAML's cost_strategy")
    parser.add_argument(
        "--config-file",
        dest="config_file",
        default=None,
        help="the YAML to plan from (default: the script's own --config-file)",
    )
    parser.add_argument(
        CPU_DEBUG_FLAG,
        dest="cpu_debug",
        action="store_true",
        help="debugging only, not for speed: run upstream Nanotron's own trainer on CPU over gloo, with "
        "plain-torch stand-ins for flash-attn, Triton, grouped_gemm and the trainer's CUDA calls "
        "(docs/stand-ins.md); without it none of them is on the import path",
    )
    parser.add_argument(
        "--replan",
        action="store_true",
        help="on a resume, plan anew and move the checkpoint's state onto the new plan, instead of "
        "keeping the split it was trained with (nanotron_ext.resume_plan: replan)",
    )
    parser.add_argument(
        "--replan-after",
        dest="replan_after",
        metavar="K",
        default=None,
        help="after K steps, price the run from its own steps, plan split and engine again under the "
        "same memory and move to the faster plan by a re-launch in the same processes "
        "(nanotron_ext.replan.after_steps; docs/replan.md)",
    )
    parser.add_argument("script", help="the training script, e.g. run_train.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the script; returns the exit code (0, or 1/2/3 as ``nanotron-ext``'s for our own errors)."""
    exit_with_torchrun()
    from nanotron_ext.integration.replan import MoveTo
    from nanotron_ext.integration.trainer_patches import install_launcher

    opts = _parser().parse_args(argv)
    rank0 = os.environ.get("RANK", "0") == "0"
    prefix = f"nanotron_ext.run [rank {os.environ.get('RANK', '0')}]: "
    say = (lambda line: print(line, flush=True)) if rank0 else (lambda line: None)
    try:
        cfg, resume, replan = _prepare(opts, rank0, prefix, say)
        undo = install_launcher(cfg, opts.cost_strategy, resume=resume, replan=replan)
    except NanotronExtError as exc:  # one message a job, in every rank's error file (cli.failure)
        return report_rank_error(exc, prefix)
    script = Path(opts.script)
    sys.argv = [str(script), *opts.script_args]
    sys.path.insert(0, str(script.resolve().parent))  # as `python SCRIPT` would
    while True:
        move = None
        try:
            runpy.run_path(str(script), run_name="__main__")
        except MoveTo as exc:  # a re-plan's move: run the script again on the new plan, resuming its checkpoint
            move = exc.checkpoint
        except NanotronExtError as exc:  # the plan, the freeze spec or the gradient check: one message, no traceback
            code = report_rank_error(exc, prefix)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        else:
            code = EXIT_OK
        finally:
            undo()
        if move is None:
            break
        gc.collect()  # the first trainer's model, optimizer and buffers, before the new split is built
        try:
            cfg = replan.relaunch_config(cfg)
            undo = install_launcher(cfg, opts.cost_strategy, resume=locate_checkpoint(move), replan=replan, moved=True)
        except NanotronExtError as exc:
            code = report_rank_error(exc, prefix)
            break
    if code == EXIT_OK and replan is not None:
        for line in replan.measured_lines():
            say(line)
        if rank0 and (written := replan.write_record()) is not None:
            say(f"nanotron_ext: replan: its record (every turn, the verdict, the moves) written to {written}")
    close_process_groups(code)
    return code


def _prepare(
    opts: argparse.Namespace, rank0: bool, prefix: str, say: Any
) -> tuple[PlannerConfig, ResumeSource | None, LauncherReplan | None]:
    """The launch's config (engine and vocabulary shards resolved), the checkpoint it resumes and its re-plan,
    checked before anything is built."""
    from nanotron_ext.integration.replan import LauncherReplan

    if opts.cpu_debug:  # before anything imports Nanotron's models, which import flash_attn
        from nanotron_ext.integration.cpu_standins import enable

        enable(say=lambda line: say(f"nanotron_ext: {line}"))
    script = Path(opts.script)
    if not script.is_file():
        raise ConfigError(f"training script {opts.script!r} not found; give the path of e.g. Nanotron's run_train.py")
    config_file = opts.config_file or config_file_of(opts.script_args)
    if config_file is None:
        raise ConfigError(
            f"no config file in the script's arguments {opts.script_args}; pass the script's --config-file "
            f"CONFIG.yaml (or --config-file before the script name)"
        )
    # Keys the installed Nanotron reads are known (a fork's own); any other key no Nanotron reads is a
    # warning, and the script's own loader has the final word on it. Said once, by rank 0, on one line.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config_file, cost_strategy=opts.cost_strategy, nanotron_keys=installed_nanotron_keys())
    if rank0:
        for w in caught:
            print(f"{prefix}warning: {w.message}", file=sys.stderr, flush=True)
    if opts.replan:
        cfg = cfg.with_overrides(resume_plan="replan")
    cfg = with_replan_after(cfg, opts.replan_after)
    get_strategy(cfg.ext.cost_strategy)  # an unknown name fails here, listing the known ones
    # A half-written checkpoint, or one of another model, stops every rank here, before anything is built.
    resume = locate_checkpoint((cfg.nanotron.get("checkpoints") or {}).get("resume_checkpoint_path"))
    if resume is not None:
        check_same_model(resume, cfg)
    kept = kept_vocab_shards(resume, cfg, cfg.ext.resume_plan)
    if kept is not None:
        cfg = cfg.with_overrides(vocab_shards=kept)
    cfg, engine_choice = launch_engine(cfg)  # a V priced as Nanotron's trainer runs it; contiguous under a re-plan
    if engine_choice is not None:
        say("nanotron_ext: " + "\n  ".join(engine_choice.lines()))
    cfg, choice = resolve_vocab_shards(cfg)
    if choice is not None or kept is not None:
        how = f"kept from {resume.label}" if kept is not None and resume is not None else "chosen now"
        say(f"nanotron_ext: vocab_shards: auto -> {cfg.vocab_shards} ({how})")
    replan = None
    if cfg.ext.replan.after_steps is not None:
        replan = LauncherReplan(cfg, engine_was_auto=engine_choice is not None, say=say)
    return cfg, resume, replan


#: Seconds a rank that stops with an error gives its process groups to close before it exits without them.
CLOSE_AFTER_ERROR_S = 5.0


def close_process_groups(code: int) -> None:
    """Destroy torch.distributed's process groups while the interpreter is still whole, before exiting with ``code``.

    Nanotron's scripts leave them to the interpreter's exit, where gloo's worker threads can abort the rank
    ("terminate called without an active exception", pytorch/pytorch#179291): seen in CI after a clean run's last
    checkpoint and after a refused resume, so torchrun reported -6 instead of the run's 0 or 2. After an error a peer
    may still hold a transfer with this rank open: if closing takes over :data:`CLOSE_AFTER_ERROR_S`, the rank exits
    with ``code`` at once, without the interpreter's teardown.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if code == EXIT_OK:
        dist.destroy_process_group()
        return
    closing = threading.Thread(target=dist.destroy_process_group, name="nanotron-ext-close", daemon=True)
    closing.start()
    closing.join(CLOSE_AFTER_ERROR_S)
    if closing.is_alive():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
