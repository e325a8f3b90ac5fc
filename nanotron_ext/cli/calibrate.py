"""``nanotron-ext calibrate``: measure this machine into a profile that ``plan`` and ``simulate`` read (``--machine``).

Under torchrun with the config's ``pp × dp × tp`` ranks and ``pp >= 2`` it takes the in-run profile by default: the
config's split trained for a few steps through Nanotron's engine (the CPU runtime), every block priced from the
engine's own clock (:mod:`nanotron_ext.runtime.in_run_calibrate`). ``--standalone`` (and wherever the in-run profile
cannot be taken: alone, at ``pp = 1``, under ``pp_engine: zbv``, beside a Nanotron the CPU runtime does not run)
measures every distinct block alone, and under torchrun the links between pipeline neighbours, Nanotron's
per-transfer overhead and the gradient all-reduces; it says which profile it took and why::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 -m nanotron_ext.cli calibrate CONFIG --out machine.json
    nanotron-ext calibrate CONFIG --standalone --out machine.json

Under torchrun ``--backend`` picks the process group's backend: by default NCCL when CUDA gives every local
rank a GPU of its own, else gloo (NCCL refuses two ranks on one GPU); gloo on CUDA times host-staged links.
Rank 0 writes the file and prints a summary. What is measured and how: :mod:`nanotron_ext.machine.calibrate`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

from nanotron_ext.cli.common import EXIT_OK, check_outputs, legend, report_rank_error
from nanotron_ext.config import VOCAB_SHARDS_AUTO, PlannerConfig, bundled_config, load_config
from nanotron_ext.costs.analytic import trainable_before, training_flops
from nanotron_ext.costs.profiled import DEFAULT_REPEATS
from nanotron_ext.devices import DEVICE_ENV, DEVICE_TYPES, device_type, use_device
from nanotron_ext.errors import ConfigError
from nanotron_ext.machine import MachineProfile, block_signature
from nanotron_ext.machine.calibrate import BLOCK_ROUNDS_PER_REPEAT, calibrate, calibration_blocks, host_staged
from nanotron_ext.machine.calibrate_comm import LINK_ROUNDS_PER_REPEAT
from nanotron_ext.machine.in_run import IN_RUN_STEPS, IN_RUN_WARMUP_STEPS
from nanotron_ext.machine.spread import uncertain_figures
from nanotron_ext.outputs import atomic_write_text
from nanotron_ext.procs import RENDEZVOUS_VARIABLES, exit_with_torchrun
from nanotron_ext.report import compact_names, table
from nanotron_ext.schedule import V_ENGINE

__all__ = ["BACKENDS", "add_subcommand", "choose_backend", "cmd_calibrate", "profile_method", "summary"]

#: The process-group backends ``--backend`` accepts.
BACKENDS = ("gloo", "nccl")


def add_subcommand(subparsers: Any) -> None:
    """Register ``calibrate`` on the ``nanotron-ext`` parser."""
    p = subparsers.add_parser(
        "calibrate",
        help="measure this machine into a profile for plan/simulate --machine (links: under torchrun)",
        description="Measure every distinct block of the config on this machine and, under torchrun with the "
        "config's pp*dp*tp ranks, the p2p links between pipeline neighbours, Nanotron's per-call overheads and "
        "the gradient all-reduces; write the machine profile that `plan`/`simulate --machine FILE` read.",
    )
    p.add_argument("config", nargs="?", help="Nanotron YAML (default: the bundled tiny large-vocab example)")
    p.add_argument("--out", required=True, metavar="FILE", help="the profile to write (JSON; rank 0 writes it)")
    p.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        metavar="N",
        help=f"timed rounds per measurement (default {DEFAULT_REPEATS}): blocks take "
        f"{BLOCK_ROUNDS_PER_REPEAT}× as many and keep their fastest, link sizes "
        f"{LINK_ROUNDS_PER_REPEAT}× and keep their median",
    )
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed runs first (default 2)")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--in-run",
        dest="in_run",
        action="store_true",
        help="price blocks from real training steps of the config's split through Nanotron's engine (under "
        "torchrun, the CPU runtime): each block's forward, backward and W inside the pipeline, waits left out; "
        "the default under torchrun at pp >= 2 (docs/machine.md#two-ways-to-price-a-block)",
    )
    which.add_argument(
        "--standalone",
        action="store_true",
        help="time each block alone (and under torchrun the links and all-reduces) instead of training steps: "
        "the way to price a machine you cannot train on yet",
    )
    p.add_argument(
        "--probes",
        action="store_true",
        help="with --in-run: train probe splits that put every block on every stage it can take, not only "
        "the config's split",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=IN_RUN_STEPS,
        metavar="N",
        help=f"with --in-run: timed training steps per split (default {IN_RUN_STEPS})",
    )
    p.add_argument(
        "--warmup-steps",
        dest="warmup_steps",
        type=int,
        default=IN_RUN_WARMUP_STEPS,
        metavar="N",
        help=f"with --in-run: untimed training steps first (default {IN_RUN_WARMUP_STEPS})",
    )
    p.add_argument(
        "--machine",
        metavar="FILE",
        default=None,
        help="with --in-run: build on this standalone profile instead of calibrating first",
    )
    p.add_argument(
        "--device",
        choices=DEVICE_TYPES,
        default=None,
        help=f"where blocks run (default: ${DEVICE_ENV}, else cuda when torch sees a GPU, else cpu); "
        "the CPU runtime and `profiled` follow the same rule, and a profile is refused for a run on another "
        "device",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="process group under torchrun (default: nccl when CUDA gives each local rank its own GPU, "
        "else gloo; gloo on CUDA measures host-staged links)",
    )
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Handler of ``nanotron-ext calibrate``; returns the exit code (2: config, usage, output path)."""
    rank = os.environ.get("RANK")
    prefix = "nanotron-ext calibrate: " + ("" if rank is None else f"error on rank {rank}: ")
    try:
        exit_with_torchrun()
        use_device(args.device)
        if rank in (None, "0"):
            check_outputs((args.out, "--out"))
        cfg = load_config(args.config or bundled_config())
        in_run, why = profile_method(cfg, args)
        _check_in_run_flags(args, in_run)
        if in_run:
            from nanotron_ext.runtime.in_run_calibrate import calibrate_in_run  # trains: the CPU runtime

            profile = calibrate_in_run(
                cfg,
                probes=args.probes,
                steps=args.steps,
                warmup_steps=args.warmup_steps,
                base=args.machine,
                warmup=args.warmup,
                repeats=args.repeats,
            )
        else:
            with _process_group(args.backend):
                profile = calibrate(cfg, warmup=args.warmup, repeats=args.repeats)
        if rank in (None, "0"):
            atomic_write_text(args.out, profile.to_json() + "\n")
            print(f"profile: {why}\n")
            print(summary(cfg, profile))
            print(f"\nwrote {args.out}: `nanotron-ext plan CONFIG --machine {args.out}` plans with it")
    except Exception as exc:  # one message a job and the documented exit code, never a traceback
        return report_rank_error(exc, prefix, tag=rank is None)
    return EXIT_OK


def profile_method(cfg: PlannerConfig, args: argparse.Namespace) -> tuple[bool, str]:
    """Whether this calibration takes the in-run profile, and a line saying which profile and why: ``--in-run`` and
    ``--standalone`` as asked; by default in-run under torchrun at ``pp >= 2`` wherever the CPU runtime can train the
    config, else standalone, with the reason."""
    if args.in_run:
        return True, IN_RUN_TAKEN + " (--in-run)"
    if args.standalone:
        return False, STANDALONE_TAKEN + " (--standalone)"
    if args.backend == "nccl":
        why = "--backend nccl: the in-run steps run over gloo"
    elif not all(v in os.environ for v in RENDEZVOUS_VARIABLES):
        why = "not under torchrun: the in-run profile trains the config's split with its pp*dp*tp ranks"
    elif cfg.run.pp < 2:
        why = "pp = 1: there is no pipeline to price from its steps"
    elif cfg.run.engine == V_ENGINE:
        why = "pp_engine: zbv: the CPU runtime's in-run steps train contiguous splits"
    elif _installed_nanotron() != "0.2":
        why = (
            "the in-run profile trains on the CPU runtime, which runs Nanotron 0.2's engines, and the Nanotron "
            "installed here is upstream main; its own trainer prices a run from its steps with the launcher's "
            "--replan-after K (docs/replan.md)"
        )
    else:
        return True, IN_RUN_TAKEN + " (the default under torchrun at pp >= 2; --standalone times blocks alone)"
    return False, f"{STANDALONE_TAKEN}: {why}; blocks alone price a step a few to 15 % fast (docs/machine.md)"


#: What each profile is, as ``calibrate`` says it took it.
IN_RUN_TAKEN = "in-run: the config's split trained through Nanotron's engine, each block priced from its clock"
STANDALONE_TAKEN = "standalone: each block timed alone"


def _installed_nanotron() -> str:
    """``0.2`` or ``upstream`` (main ships Qwen2), from the installed package's files, without importing it."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("nanotron")
    if spec is None or not spec.submodule_search_locations:
        return "none"
    package = Path(next(iter(spec.submodule_search_locations)))
    return "upstream" if (package / "models" / "qwen.py").is_file() else "0.2"


def _check_in_run_flags(args: argparse.Namespace, in_run: bool) -> None:
    """Refuse the flags that only the in-run profile reads without it, and a backend it cannot use (the CPU
    runtime's pipeline is gloo)."""
    if in_run:
        if args.backend == "nccl":
            raise ConfigError(
                "calibrate --in-run trains on the CPU runtime, whose pipeline runs over gloo: drop "
                "--backend nccl (or calibrate with --standalone for NCCL's links)"
            )
        return
    given = [
        flag
        for flag, value, default in (
            ("--probes", args.probes, False),
            ("--steps", args.steps, IN_RUN_STEPS),
            ("--warmup-steps", args.warmup_steps, IN_RUN_WARMUP_STEPS),
            ("--machine", args.machine, None),
        )
        if value != default
    ]
    if given:
        raise ConfigError(
            f"calibrate: {', '.join(given)} only apply to the in-run profile (training steps priced in the "
            f"engine), which this calibration does not take; drop them, or take it (--in-run, under torchrun)"
        )


def choose_backend(requested: str | None) -> str:
    """The backend for this rank: ``requested``, or by default NCCL when CUDA gives every local rank
    (``$LOCAL_WORLD_SIZE``) a GPU of its own, else gloo.

    Raises:
        ConfigError: ``nccl`` without CUDA, or with fewer GPUs than local ranks (NCCL cannot put two ranks on
            one GPU); the message names the fix (``--backend gloo``, host-staged links).
    """
    import torch

    on_cuda = device_type() == "cuda"
    gpus = torch.cuda.device_count() if on_cuda else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if requested is None:
        return "nccl" if 0 < local <= gpus else "gloo"
    if requested == "nccl" and gpus == 0:
        where = (
            f"torch sees no CUDA device here (torch {torch.__version__})"
            if not torch.cuda.is_available()
            else "blocks run on the CPU here (--device cpu or $NANOTRON_EXT_DEVICE)"
        )
        raise ConfigError(
            f"calibrate --backend nccl needs CUDA, but {where}; use --backend gloo, the default "
            f"without a GPU, or --device cuda"
        )
    if requested == "nccl" and local > gpus:
        raise ConfigError(
            f"calibrate --backend nccl: {local} ranks on this node but {gpus} GPU(s), and NCCL cannot put two ranks "
            f"on one GPU; use --backend gloo (links host-staged through CPU memory, slower than NCCL's) or launch "
            f"at most {gpus} rank(s) per node"
        )
    return requested


@contextlib.contextmanager
def _process_group(requested: str | None) -> Iterator[None]:
    """Under torchrun (its rendezvous variables set) the default process group, made here unless it exists, with
    :func:`choose_backend`'s backend; on CUDA each rank takes ``cuda:{LOCAL_RANK % device_count}``. Its timeout is
    ``$NANOTRON_EXT_TIMEOUT_S``."""
    if not all(v in os.environ for v in RENDEZVOUS_VARIABLES):
        yield
        return
    import torch
    import torch.distributed as dist

    from nanotron_ext.runtime.context import timeout_from_env

    if dist.is_initialized():
        yield
        return
    backend = choose_backend(requested)
    if device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_from_env()))
    try:
        yield
    finally:
        dist.destroy_process_group()


def summary(cfg: PlannerConfig, profile: MachineProfile) -> str:
    """The profile's header line, its measured blocks, and its links, syncs and overheads, as aligned tables."""
    lines = [f"{cfg.source}", f"machine: {profile.describe()}", legend(), "", _block_table(cfg, profile), ""]
    staged = host_staged(profile.key.device, profile.key.backend)
    how = " (host-staged)" if staged else ""
    rows: list[list[object]] = [
        [f"p2p stage {link.src} -> {link.dst}{how}", _us(link.latency), _gbps(link.bytes_per_second), _pct(link.spread)]
        for link in profile.links
    ]
    for name, c in (
        ("dp gradient all-reduce", profile.dp_allreduce),
        ("tied embedding all-reduce", profile.tied_allreduce),
    ):
        if c is not None:
            rows.append([f"{name} (bus)", _us(c.latency), _gbps(c.bus_bytes_per_second), "-"])
    o = profile.overhead
    rows.append(["PipelineBlock call (engine overhead)", _us(o.block_call), "-", "-"])
    if profile.links:
        rows.append(["Nanotron P2P send + recv (engine overhead)", _us(o.send + o.recv), "-", "-"])
    lines.append(table(["measured", "latency µs", "GB/s", "± %"], rows))
    if profile.key.pp is None:
        lines.append(
            "p2p, its overhead and the gradient syncs not measured: run under torchrun with the config's pp*dp*tp ranks"
        )
    if staged and profile.links:
        lines.append(
            "host-staged: gloo carries host memory only, so every transfer and sync above includes a "
            "device->host and a host->device copy; NCCL between GPUs (NVLink, InfiniBand) is faster: "
            "plan a multi-GPU run with a profile calibrated there"
        )
    lines += [f"WARNING: {u.message()}" for u in uncertain_figures(cfg, profile)]
    return "\n".join(lines)


def _block_table(cfg: PlannerConfig, profile: MachineProfile) -> str:
    """One row per measured block: which blocks share it, its times, its training FLOP rate."""
    shorts: dict[str, list[str]] = {}
    suffix: dict[str, str] = {}
    flops: dict[str, float] = {}
    for trial, blocks in calibration_blocks(cfg):
        for b, grad, work in zip(blocks, trainable_before(blocks), training_flops(blocks)):
            sig = block_signature(b, input_grad=grad)
            if b.short not in shorts.setdefault(sig, []):
                shorts[sig].append(b.short)
            flops.setdefault(sig, work)
            if b.role == "vocab_shard" and cfg.ext.vocab_shards == VOCAB_SHARDS_AUTO:
                suffix.setdefault(sig, f" (K={trial.ext.vocab_shards})")
    rows = []
    for sig, names in shorts.items():
        cost = profile.block(sig)
        if cost is None:
            continue
        total = cost.forward + cost.backward
        rate = f"{flops[sig] / total / 1e9:.3g}" if total > 0 and flops[sig] > 0 else "-"
        spread = cost.spread or (None, None, None)
        rows.append(
            [
                compact_names(names) + suffix.get(sig, ""),
                _ms(cost.forward),
                _ms(cost.backward),
                _ms(cost.update),
                *map(_pct, spread),
                rate,
            ]
        )
    return table(
        ["block", "forward ms", "backward ms", "update ms", "± fwd %", "± bwd %", "± update %", "GFLOP/s"], rows
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def _pct(spread: float | None) -> str:
    """A spread as ``0.84`` (percent), ``-`` where not measured."""
    return "-" if spread is None else f"{spread * 100:.2f}"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.4g}"


def _gbps(bytes_per_second: float) -> str:
    return f"{bytes_per_second / 1e9:.4g}"
