"""What every subcommand shares: how flags are parsed and checked (a choice's "did you mean", a count's and a
rate's types), the config arguments and how they are read, and how tables, their notes, verdicts and ratios are
printed. Exit codes and error reporting live in :mod:`nanotron_ext.cli.failure` (re-exported here).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Any, NoReturn, get_args

from nanotron_ext.cli.failure import (
    EXIT_CLOSED_PIPE,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_RUNTIME,
    EXIT_USAGE,
    TRACEBACK_ENV,
    exit_code_for,
    on_a_job,
    report_error,
    report_once_a_job,
    report_rank_error,
)
from nanotron_ext.config import BlockTimes, PlannerConfig, bundled_config, load_config
from nanotron_ext.errors import ConfigError, suggest
from nanotron_ext.plan import EngineChoice, Plan
from nanotron_ext.plan.compare import why_invalid
from nanotron_ext.report import table
from nanotron_ext.schedule import ENGINE_AUTO, ENGINES, V_ENGINE
from nanotron_ext.schedule.simulator import SimResult
from nanotron_ext.strategies import available_strategies

__all__ = [
    "COLUMNS_DOC",
    "EXIT_CLOSED_PIPE",
    "against",
    "best_valid_cell",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_RUNTIME",
    "EXIT_USAGE",
    "RATIO_MEANING",
    "TRACEBACK_ENV",
    "Notes",
    "Parser",
    "add_config_args",
    "check_outputs",
    "config_from_args",
    "error_cell",
    "exit_code_for",
    "choice_lines",
    "legend",
    "model_name",
    "non_negative_int",
    "positive_int",
    "positive_number",
    "titled_table",
    "report_error",
    "report_rank_error",
    "speed_cell",
    "stage_cell",
    "verdict_cell",
    "verdict_line",
    "version_line",
    "warn_memory",
]


class Parser(argparse.ArgumentParser):
    """``argparse`` with "did you mean" for a choice (an engine, ``--times``, a subcommand): the same rule as
    every other name a user types (:func:`nanotron_ext.errors.did_you_mean`); a usage error is one line, as
    every other error is."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            known = [str(c) for c in action.choices]
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}; {suggest(value, known)}choose from {', '.join(known)}"
            )

    def error(self, message: str) -> NoReturn:
        """One line on stderr, with where the flags are listed; exit 2."""
        where = (
            f"`{self.prog} --help` lists the commands, `{self.prog} COMMAND --help` their flags"
            if self._subparsers is not None
            else f"`{self.prog} --help` lists every flag"
        )
        line = f"{self.prog}: error: {message} ({where})"
        if on_a_job():  # every rank parses the same flags: said once a job, and torchrun's root cause
            self.exit(report_once_a_job(line, EXIT_USAGE))
        self.exit(EXIT_USAGE, line + "\n")


def positive_int(text: str) -> int:
    """``argparse`` type of a count (``--pp``, ``--micro-batches``, ``--steps``): a whole number, at least 1."""
    return _whole_number(text, least=1)


def non_negative_int(text: str) -> int:
    """``argparse`` type of a seed: a whole number, at least 0."""
    return _whole_number(text, least=0)


def _whole_number(text: str, *, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least {least}; give e.g. {least + 1}")
    return value


def positive_number(text: str) -> float:
    """``argparse`` type of a rate (``--tflops``, ``--p2p-gbps``): a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number; give e.g. 400 or 12.5")
    return value


def version_line() -> str:
    """``nanotron-ext 0.1.0 (Nanotron 0.2)``: this package's installed version, and the Nanotron beside it."""
    from importlib import metadata

    def installed(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    ours = installed("nanotron-ext") or "unknown (not installed; run pip install -e .)"
    theirs = installed("nanotron")
    return f"nanotron-ext {ours} ({f'Nanotron {theirs}' if theirs else 'Nanotron not installed'})"


def check_outputs(*paths: tuple[str | None, str], suffixes: tuple[str, ...] | None = None) -> None:
    """Check every ``(path, flag)`` output before any work starts (see :func:`nanotron_ext.outputs.check_output_path`).

    Raises:
        ConfigError: an output is a folder, lies under a file, cannot be written, or has a wrong suffix.
    """
    from nanotron_ext.outputs import check_output_path

    for path, flag in paths:
        if path is not None:
            check_output_path(
                path, flag, suffixes=suffixes, default_suffix=".json" if suffixes is None else next(iter(suffixes))
            )


#: A stage estimated above this many bytes gets a warning: no accelerator comes close (the largest hold 0.25 TiB).
MEMORY_WARN_BYTES = 2**40


def warn_memory(plan: Any) -> None:
    """Warn on stderr when a stage of ``plan`` needs more than :data:`MEMORY_WARN_BYTES` (1 TiB): the plan is
    printed, but no machine could run it — usually a shape typo (an extra digit in ``vocab_size`` or
    ``hidden_size``) or far too few stages."""
    stages = getattr(plan, "stages", ())
    if not stages:
        return
    worst = max(stages, key=lambda s: s.memory_bytes)
    if worst.memory_bytes > MEMORY_WARN_BYTES:
        print(
            f"nanotron-ext: warning: stage {worst.stage} of the {plan.strategy!r} plan needs about "
            f"{worst.memory_bytes / 2**40:.3g} TiB, more than any accelerator holds; check model_config's "
            f"sizes for a typo, or raise pp, tp or dp with ZeRO",
            file=sys.stderr,
            flush=True,
        )


def stage_cell(stage_map: str) -> str:
    """A plan's ``stage_map()`` for a table cell: a run of three or more empty stages is written ``-×N``, so
    that pp=100 over seven blocks does not print a row thousands of characters wide."""
    return re.sub(r"-(?:\|-){2,}", lambda m: f"-×{m.group(0).count('-')}", stage_map)


class Notes:
    """Messages too long for a table cell: the cell carries a tag (``[1]``) and the whole message is printed under
    the table, so that no message is ever cut."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def tag(self, message: object) -> str:
        """``[N]`` for ``message`` (one line, whole), added to the notes."""
        self.messages.append(" ".join(str(message).split()))
        return f"[{len(self.messages)}]"

    def __str__(self) -> str:
        return "\n".join(f"[{i}] {m}" for i, m in enumerate(self.messages, 1))


def error_cell(what: str, error: object, notes: Notes) -> str:
    """``cannot plan [1]``: a row's error as a short tag, its message under the table."""
    return f"{what} {notes.tag(error)}"


def verdict_cell(verdict: str, notes: Notes | None = None, keep: int = 4) -> str:
    """A plan's verdict for a table cell: at most ``keep`` finding codes, then ``+N more`` and, with ``notes``,
    a tag whose note is the whole verdict."""
    head, sep, codes = verdict.partition(" (")
    items = codes.rstrip(")").split(", ") if sep else []
    if len(items) <= keep:
        return verdict
    tag = f" {notes.tag(verdict)}" if notes is not None else ""
    return f"{head} ({', '.join(items[:keep])}, +{len(items) - keep} more){tag}"


def titled_table(title: str, headers: list[str], rows: list[list[object]], notes: Notes | None = None) -> str:
    """A table the way every subcommand prints one: its title with the :func:`legend`, the table, then the
    notes its cells point to."""
    text = f"{title}\n{legend()}\n\n{table(headers, rows)}"
    return text + (f"\n\n{notes}" if notes is not None and notes.messages else "")


#: Where every column of every table is defined (docs/cli.md's "Columns" section).
COLUMNS_DOC = "docs/cli.md#columns"
#: How every ratio reads, the same in every table and line.
RATIO_MEANING = "ratios (x) are speed: the other plan's time ÷ this one's, so above 1 means this one is faster"


def legend() -> str:
    """The line under a table's title: where its columns are defined and how its ratios read."""
    return f"columns: {COLUMNS_DOC}; {RATIO_MEANING}"


def speed_cell(other: float | None, this: float | None) -> str:
    """``1.234x``: this plan's speed over the other's (``other ÷ this``, times or loads), or ``-`` when either
    is missing or zero. The one way every ratio is computed (see :data:`RATIO_MEANING`)."""
    if not other or not this or not math.isfinite(other) or not math.isfinite(this):
        return "-"
    return f"{other / this:.3f}x"


def against(name: str, plan: Plan | None) -> str:
    """``Nanotron's split does not fit: stage 0 needs 94.7 GiB, over ...`` when ``plan``, which a line or a column
    compares with, cannot train; ``""`` when it can (or is missing). The one way every comparison says so."""
    why = None if plan is None else why_invalid(plan)
    return "" if why is None else f"{name} {why}"


def best_valid_cell(best: Plan | None, plan: Plan) -> str:
    """``0.917x``: the best valid split's slowest stage ÷ ``plan``'s (train FLOPs/mb), or ``-`` when no split is
    valid (:func:`nanotron_ext.plan.compare.best_valid_split`)."""
    return speed_cell(None if best is None else best.slowest_flops, plan.slowest_flops)


def verdict_line(plan: Plan, result: SimResult | None = None) -> str:
    """A plan's last line, agreeing with its findings: INVALID; VALID; or VALID with frozen-only stages and what
    they cost (each one's idle share of the simulated step, when ``result`` is given)."""
    if not plan.ok:
        return "INVALID: this plan cannot train"
    frozen = [f.stage for f in plan.findings if f.code == "no-trainable" and f.stage is not None]
    if not frozen:
        return "VALID: every stage has parameters to train"
    many = len(frozen) > 1
    idle = ""
    if result is not None and result.step_time > 0:
        shares = ", ".join(f"{result.idle[k] / result.step_time:.0%}" for k in frozen)
        idle = f"; idle {shares} of the simulated step"
    return (
        f"VALID with {len(frozen)} frozen-only stage{'s' if many else ''} ({', '.join(map(str, frozen))}): "
        f"{'they compute but hold' if many else 'it computes but holds'} nothing to train{idle}"
    )


def add_config_args(
    p: argparse.ArgumentParser, *, positional: bool = True, micro_batches: bool = False, machine: bool = False
) -> None:
    """The config file (positional, optional) and the ``--cost-strategy``, ``--pp`` and ``--engine`` overrides
    (and ``--micro-batches`` with ``micro_batches``; the machine and its overrides with ``machine``)."""
    if positional:
        p.add_argument("config", nargs="?", help="Nanotron YAML (default: the bundled tiny large-vocab example)")
    p.add_argument(
        "--cost-strategy",
        dest="cost_strategy",
        metavar="NAME",
        help=f"overrides the YAML; one of {', '.join(available_strategies())} or package.module:attr",
    )
    p.add_argument("--pp", type=positive_int, metavar="N", help="overrides parallelism.pp")
    p.add_argument(
        "--engine",
        choices=(*ENGINES, V_ENGINE, ENGINE_AUTO),
        default=None,
        help="overrides parallelism.pp_engine: afab, 1f1b, zb1p or zb2p (zero-bubble ZB-H1 and ZB-H2: "
        "1F1B with deferred weight gradients; see docs/zero-bubble.md), zbv (ZB-V, two chunks per "
        "rank; docs/zbv.md), or auto (the fastest of 1f1b, zb1p, zb2p and zbv whose plan fits the memory)",
    )
    if micro_batches:
        p.add_argument(
            "--micro-batches",
            dest="micro_batches",
            type=positive_int,
            metavar="N",
            help="overrides tokens.batch_accumulation_per_replica (a dry run at another pp usually "
            "changes it too; 1f1b needs at least pp - 1)",
        )
    if machine:
        _add_machine_args(p)


def _add_machine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "machine",
        "what time costs: a calibrated profile, or the analytic H100 model "
        "(named in every table header); the rest override it",
    )
    g.add_argument(
        "--machine",
        metavar="FILE",
        help="machine profile from `nanotron-ext calibrate` (overrides nanotron_ext.machine)",
    )
    g.add_argument(
        "--times",
        choices=get_args(BlockTimes),
        default=None,
        help="block times: machine (the profile's, default), flops (one FLOP rate for every block), "
        "profiled (every block measured on this machine now, cached)",
    )
    g.add_argument(
        "--tflops",
        type=positive_number,
        metavar="X",
        help="price every block at X TFLOP/s (drops measured block times)",
    )
    g.add_argument(
        "--p2p-gbps",
        dest="p2p_gbps",
        type=positive_number,
        metavar="Y",
        help="every p2p link at Y GB/s (10^9 bytes/s), keeping the profile's latency",
    )


#: Each override flag, the argument it sets and the keyword of :meth:`PlannerConfig.with_overrides` it goes to.
OVERRIDES = (
    ("--cost-strategy", "cost_strategy", "cost_strategy"),
    ("--pp", "pp", "pp"),
    ("--micro-batches", "micro_batches", "n_micro_batches"),
    ("--engine", "engine", "engine"),
    ("--machine", "machine", "machine"),
    ("--times", "times", "times"),
    ("--tflops", "tflops", "tflops"),
    ("--p2p-gbps", "p2p_gbps", "p2p_gbps"),
)


def config_from_args(args: argparse.Namespace, path: str | None) -> PlannerConfig:
    """The config at ``path`` (the bundled example when None) with the command line's overrides.

    Raises:
        ConfigError: the file's own error as it is; an override's, after the flags given (``--times profiled
            --tflops 3: ...``), so that a message naming a YAML key says which flag set it.
    """
    cfg = load_config(path or bundled_config())
    given = {
        flag: (keyword, value) for flag, attr, keyword in OVERRIDES if (value := getattr(args, attr, None)) is not None
    }
    try:
        return cfg.with_overrides(**{keyword: value for keyword, value in given.values()})
    except ConfigError as exc:
        flags = " ".join(
            f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}" for flag, (_, value) in given.items()
        )
        raise ConfigError(f"{flags}: {exc}") from exc


def model_name(cfg: PlannerConfig) -> str:
    """The config file's name without ``.yaml``: what a picture's title calls the model."""
    return cfg.source.rsplit("/", 1)[-1].removesuffix(".yaml")


def choice_lines(choice: EngineChoice | None) -> str:
    """``pp_engine: auto -> zb1p: ...``, the runner-up and the engines passed over, each on a line of its own after a
    newline and two spaces (nothing without ``auto``): what a header says of ``auto``'s choice."""
    return "" if choice is None else "".join(f"\n  {line}" for line in choice.lines())
