"""How exactly a checkpoint resumes under another plan, measured on several base plans (docs/checkpoints.md's table).

Upstream Nanotron main's own trainer on CPU (``python -m nanotron_ext.run --cpu-debug``, gloo ranks), the tiny Llama of
``tests/upstream/test_resume.py`` (hidden 16, 2 layers, vocabulary 50276, 8 samples a step) with gradient clipping on
(``clip_grad: 1.0``, upstream's default; ``--clip none`` turns it off). For each base plan A: 6 steps saving at 2, 4
and 6; then its checkpoint 4 resumed for steps 5 and 6 under A itself (the reference) and under each plan B. A
resume under B is compared with the resume under A, weight by weight at step 6 (the reference the docs define), and
the resume under A with A's uninterrupted run.

Columns: the largest ``|w - w_ref|`` of any weight; the same as a share of a step (per weight, over the largest
change the two resumed steps made to it; the largest such share); whether the losses logged at steps 5 and 6 are
equal; and the verdict (``bit-identical``, or ``within 1 %`` of a step, the tolerance of ``test_resume.py``).

Usage (upstream Nanotron main installed, its source at ../shared/upstream/nanotron)::

    python benchmarks/resume_exactness.py [--bases A1,A2,...] [--clip 1.0|none] [--out PATH]

35 runs of 10-30 s each on two cores; writes JSON (default ``benchmarks/results/resume_exactness.json``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "tests"), str(ROOT / "tests" / "upstream_stubs")]

import torch  # noqa: E402
from _common import RESULTS, print_command  # noqa: E402
from tqdm import tqdm  # noqa: E402
from upstream.e2e import launch, tiny_config, whole_weights  # noqa: E402

from nanotron_ext.report import table  # noqa: E402

#: The shape of test_resume.py: 4 micro-batches of 2 (1F1B needs pp - 1 of them at pp=4), a vocabulary tp=2 splits
#: without padding.
SHAPE = {
    "tokens__micro_batch_size": 2,
    "tokens__batch_accumulation_per_replica": 4,
    "model__model_config__vocab_size": 50276,
}
#: A share of a step above this fails test_resume.py (MOVE_TOLERANCE there).
TOLERANCE = 0.01


@dataclass(frozen=True)
class Plan:
    """One plan: its label, ranks, config overrides (``tiny_config``'s dotted keys) and ``nanotron_ext:`` section."""

    label: str
    nproc: int
    overrides: dict[str, Any] = field(default_factory=dict)
    ext: dict[str, Any] = field(default_factory=dict)


def _layout(layout: str, pp: int, **overrides: Any) -> Plan:
    nproc = pp * overrides.get("parallelism__tp", 1) * overrides.get("parallelism__dp", 1)
    return Plan(f"pp={pp} {layout}", nproc, {"pp": pp, **overrides}, {"cost_strategy": "layout", "layout": layout})


def _chain(layout: str, shards: int) -> Plan:
    plan = _layout(layout, 2)
    return Plan(f"{plan.label} (vocab_shards {shards})", 2, plan.overrides, {**plan.ext, "vocab_shards": shards})


TP2 = Plan("pp=1 tp=2", 2, {"pp": 1, "parallelism__tp": 2}, {"cost_strategy": "constrained"})
#: ZeRO-1 over two replicas, with the same 8 samples a step (2 micro-batches of 2 on each).
ZERO1 = Plan(
    "pp=1 dp=2 ZeRO-1",
    2,
    {"pp": 1, "parallelism__dp": 2, "optimizer__zero_stage": 1, "tokens__batch_accumulation_per_replica": 2},
    {"cost_strategy": "constrained"},
)


def _zb1p(plan: Plan) -> Plan:
    return Plan(f"{plan.label} zb1p", plan.nproc, {**plan.overrides, "parallelism__pp_engine": "zb1p"}, plan.ext)


#: Base plans A, each with the changes B it is resumed under, as (kind of change, B).
A1, A2 = _layout("E,t|t,L", 2), _layout("E,t*2,N|H,C,X", 2)
A3, A4 = _layout("E|t|t|L", 4), _layout("E,t*2,L", 1)
A5 = _chain("E,t*2,N,V|V", 2)
BASES: dict[str, tuple[Plan, list[tuple[str, Plan]]]] = {
    "A1": (
        A1,
        [
            ("split", A2),
            ("split", _layout("E|t,t,L", 2)),
            ("pp", A4),
            ("pp", A3),
            ("tp", TP2),
            ("ZeRO-1 dp", ZERO1),
            ("engine", _zb1p(A1)),
            ("vocabulary shards", A5),
        ],
    ),
    "A2": (
        A2,
        [
            ("split", A1),
            ("pp", A4),
            ("pp", A3),
            ("tp", TP2),
            ("ZeRO-1 dp", ZERO1),
            ("engine", _zb1p(A2)),
            ("vocabulary shards", _chain("E,t*2,N,V|V*2", 3)),
        ],
    ),
    "A3": (A3, [("split", _layout("E|t|t,N|H,C,X", 4)), ("pp", A1), ("engine", _zb1p(A3))]),
    "A4": (A4, [("pp", A1), ("pp", A2), ("tp", TP2), ("ZeRO-1 dp", ZERO1)]),
    "A5": (A5, [("vocabulary shards", A2), ("vocabulary shards", _chain("E,t*2,N,V|V*2", 3)), ("engine", _zb1p(A5))]),
}


class RunFailed(RuntimeError):
    """A run of the trainer exited non-zero; the message is its last error line."""


@dataclass
class Row:
    base: str
    change: str
    plan: str
    max_abs: float
    share: float
    losses_equal: bool
    failure: str = ""

    @property
    def verdict(self) -> str:
        if self.failure:
            return f"failed: {self.failure}"
        if self.max_abs == 0 and self.losses_equal:
            return "bit-identical"
        return f"within {TOLERANCE:.0%}" if self.share <= TOLERANCE else "OUT OF TOLERANCE"


def _run(folder: Path, plan: Plan, clip: float | None, resume: Path | None = None) -> tuple[dict[int, float], Path]:
    folder.mkdir(parents=True)
    extra = {"checkpoints__resume_checkpoint_path": str(resume)} if resume is not None else {}
    config = tiny_config(
        folder,
        steps=6,
        checkpoints__checkpoint_interval=2,
        ext=plan.ext,
        **{**SHAPE, "optimizer__clip_grad": clip, **plan.overrides, **extra},
    )
    run = launch(config, nproc=plan.nproc)
    if run.rc != 0:
        errors = [line for line in run.out.splitlines() if "Error" in line or "error:" in line]
        raise RunFailed(f"{plan.label}: exit {run.rc}: {(errors or ['?'])[-1].strip()[:300]}")
    return run.losses, folder / "checkpoints"


def _compare(
    ref: dict[str, torch.Tensor], start: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """(largest |w - w_ref|, largest share of a step) over the weights both hold."""
    if ref.keys() != new.keys():
        raise SystemExit(f"the weights differ in name: {sorted(ref.keys() ^ new.keys())}")
    diffs = {k: float((ref[k].float() - new[k].float()).abs().max()) for k in ref}
    shares = {k: diffs[k] / float((ref[k].float() - start[k].float()).abs().max()) for k in ref}
    return max(diffs.values()), max(shares.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bases", default=",".join(BASES), help=f"base plans to run (default all: {','.join(BASES)})")
    parser.add_argument("--clip", default="1.0", help="optimizer.clip_grad: a number or none (default 1.0)")
    parser.add_argument("--out", type=Path, default=RESULTS / "resume_exactness.json")
    args = parser.parse_args(argv)
    print_command(argv)
    clip = None if args.clip.lower() == "none" else float(args.clip)
    bases = [b.strip() for b in args.bases.split(",") if b.strip()]
    unknown = [b for b in bases if b not in BASES]
    if unknown:
        parser.error(f"unknown base plan(s) {unknown}; choose from {', '.join(BASES)}")
    rows: list[Row] = []
    reference_rows: list[list[str]] = []
    total = sum(2 + len(BASES[b][1]) for b in bases)
    with tempfile.TemporaryDirectory(prefix="resume_exactness-") as tmp, tqdm(total=total, unit="run") as bar:
        for name in bases:
            base, changes = BASES[name]
            bar.set_description(f"{name}: {base.label}")
            losses, a = _run(Path(tmp) / name / "a", base, clip)
            bar.update()
            ref_losses, ref = _run(Path(tmp) / name / "ref", base, clip, resume=a / "4")
            bar.update()
            start, ref6 = whole_weights(a / "4"), whole_weights(ref / "6")
            same = all(torch.equal(ref6[k], v) for k, v in whole_weights(a / "6").items())
            reference_rows.append(
                [
                    name,
                    base.label,
                    "identical" if same else "DIFFERS",
                    str({s: losses[s] for s in (5, 6)} == ref_losses),
                ]
            )
            for i, (kind, plan) in enumerate(changes):
                bar.set_description(f"{name} -> {plan.label}")
                try:
                    new_losses, new = _run(Path(tmp) / name / f"b{i}", plan, clip, resume=a / "4")
                except RunFailed as exc:
                    rows.append(Row(name, kind, plan.label, float("nan"), float("nan"), False, str(exc)))
                else:
                    max_abs, share = _compare(ref6, start, whole_weights(new / "6"))
                    rows.append(Row(name, kind, plan.label, max_abs, share, new_losses == ref_losses))
                    shutil.rmtree(new.parent)
                bar.update()
    print(f"\nclip_grad: {clip}; reference: the base plan's checkpoint 4 resumed on that plan for steps 5-6\n")
    print(table(["base", "plan A", "resume under A vs A's uninterrupted weights", "losses equal"], reference_rows))
    print()
    print(
        table(
            ["base", "change", "plan B", "max |w - w_ref|", "share of a step", "losses equal", "verdict"],
            [
                [r.base, r.change, r.plan, f"{r.max_abs:.3g}", f"{100 * r.share:.3g} %", str(r.losses_equal), r.verdict]
                for r in rows
            ],
        )
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "clip_grad": clip,
                "bases": {b: BASES[b][0].label for b in bases},
                "reference": reference_rows,
                "rows": [{**asdict(r), "verdict": r.verdict} for r in rows],
            },
            indent=1,
        )
    )
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
