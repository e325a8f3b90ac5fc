"""Helpers of ``benchmarks/gpu_check.sh`` (run that, not this): the environment check, the derived config, the
CPU-vs-GPU loss comparison and the summary.

Subcommands (each reads and writes under OUTDIR only):

* ``env OUTDIR [REHEARSAL]``: print torch, CUDA and the devices, whether flash-attn is installed; exit 2 with a
  message that names the reason and the fix when torch sees no CUDA device (nothing written then), unless
  ``REHEARSAL`` is ``1`` (``GPU_CHECK_REHEARSAL=1``: the script rehearsed on CPU); write
  ``OUTDIR/environment.json``;
* ``configs OUTDIR``: write ``OUTDIR/configs/smollm_135m_pp2.yaml``, SmolLM-135M's shape at pp=2 in fp32 (what the
  runtime trains; 2 ranks on the one GPU), sequence 512, micro-batch 2, 4 micro-batches;
* ``compare OUTDIR [RUN REFERENCE]``: one training run's losses against another's (default: the seed model
  trained on CUDA against the same run on CPU);
* ``summary OUTDIR``: ``OUTDIR/summary.md`` from the steps' record (``steps.tsv``), the profiles and the training
  metrics; exit 1 when a step failed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "nanotron_ext" / "configs"
#: Largest relative difference between a CUDA and a CPU loss of the same step that counts as the same run.
LOSS_RTOL = 1e-3
EXIT_NO_CUDA = 2


def environment(out: Path, rehearsal: str = "0") -> int:
    """Print what this machine has; without CUDA (and not rehearsing) say so and return 2, else write
    ``environment.json``."""
    import torch

    flash = importlib.util.find_spec("flash_attn") is not None
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "flash_attn": flash,
        "rehearsal": rehearsal == "1",
    }
    print(
        f"torch {env['torch']}, built for CUDA {env['cuda']}; CUDA available: {env['cuda_available']}; "
        f"devices: {', '.join(env['devices']) or 'none'}; NCCL {env['nccl']}"
    )
    print(
        "flash-attn: "
        + ("installed, and unused: " if flash else "not installed: ")
        + "the runtime's Llama uses torch SDPA attention (nanotron_ext/models/llama.py never imports flash-attn)"
    )
    if not env["cuda_available"] and not env["rehearsal"]:
        print(
            f"gpu_check: no CUDA device: torch {env['torch']} (built for CUDA {env['cuda']}) sees none, so nothing "
            "can be measured on a GPU here. Run it on a machine with an NVIDIA GPU, its driver and a CUDA build "
            "of torch; on CPU, `nanotron-ext calibrate` and `nanotron-ext train` run as they are",
            file=sys.stderr,
        )
        return EXIT_NO_CUDA
    out.mkdir(parents=True, exist_ok=True)
    (out / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    return 0


def write_configs(out: Path) -> int:
    """``OUTDIR/configs/smollm_135m_pp2.yaml``: SmolLM-135M's shape, pp=2, fp32, a batch that trains quickly (its
    path printed); beside it ``smollm_135m_pp2_zb2p.yaml``, the same under ``pp_engine: zb2p``."""
    raw = yaml.safe_load((CONFIGS / "smollm_135m.yaml").read_text())
    raw["parallelism"].update(pp=2, dp=1, tp=1)
    raw["model"]["dtype"] = "float32"
    raw["optimizer"]["accumulate_grad_in_fp32"] = False
    raw["tokens"].update(sequence_length=512, micro_batch_size=2, batch_accumulation_per_replica=4, train_steps=5)
    raw["general"]["run"] = "smollm_135m_pp2_gpu_check"
    path = out / "configs" / "smollm_135m_pp2.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# SmolLM-135M's shape at pp=2, fp32 (written by benchmarks/gpu_check.py)\n" + yaml.safe_dump(raw))
    raw["parallelism"]["pp_engine"] = "zb2p"
    raw["general"]["run"] = "smollm_135m_pp2_zb2p_gpu_check"
    path.with_name("smollm_135m_pp2_zb2p.yaml").write_text(
        "# SmolLM-135M's shape at pp=2, fp32, zb2p (written by benchmarks/gpu_check.py)\n" + yaml.safe_dump(raw)
    )
    print(path)
    return 0


def _metrics(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def compare(out: Path, run: str = "seed_cuda", reference: str = "seed_cpu") -> int:
    """Per-step losses of training run ``run`` against ``reference`` (same weights, same data; by default the seed
    model on CUDA against it on CPU), written to ``OUTDIR/train/RUN_vs_REFERENCE.json``; 1 when they differ."""
    got, ref = _metrics(out / "train" / f"{run}.json"), _metrics(out / "train" / f"{reference}.json")
    if got is None or ref is None:
        print("compare: a training run wrote no metrics (see its log)", file=sys.stderr)
        return 1
    rel = [abs(g - c) / abs(c) for g, c in zip(got["losses"], ref["losses"])]
    record = {
        "run": run,
        "reference": reference,
        "run_losses": got["losses"],
        "reference_losses": ref["losses"],
        "max_rel_diff": max(rel),
        "rtol": LOSS_RTOL,
        "same": len(rel) == len(ref["losses"]) and max(rel) <= LOSS_RTOL,
    }
    (out / "train" / f"{run}_vs_{reference}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"{run} against {reference}, {len(rel)} steps: largest relative loss difference {max(rel):.2e} "
        f"(tolerance {LOSS_RTOL:g}): {'same run' if record['same'] else 'DIFFERENT'}"
    )
    return 0 if record["same"] else 1


def _steps(out: Path) -> list[dict[str, str]]:
    path = out / "steps.tsv"
    rows = [line.split("\t") for line in path.read_text().splitlines()] if path.exists() else []
    return [dict(zip(("name", "rc", "seconds", "log", "command"), row)) for row in rows if len(row) == 5]


def _step_table(steps: list[dict[str, str]]) -> list[str]:
    lines = ["| step | result | seconds | log | command |", "| --- | --- | ---: | --- | --- |"]
    for s in steps:
        result = {"0": "ok", "skipped": "skipped"}.get(s["rc"], f"FAILED (exit {s['rc']})")
        lines.append(f"| {s['name']} | {result} | {s['seconds']} | {s['log']} | `{s['command']}` |")
    return lines


def _profile_lines(out: Path) -> list[str]:
    from nanotron_ext.machine import load_machine

    lines = ["| profile | machine | device, backend | links: latency µs, GB/s |", "| --- | --- | --- | --- |"]
    for path in sorted((out / "profiles").glob("*.json")):
        p = load_machine(path)
        links = "; ".join(f"{k.src}->{k.dst}: {k.latency * 1e6:.1f}, {k.bytes_per_second / 1e9:.2f}" for k in p.links)
        lines.append(
            f"| {path.relative_to(out)} | {p.describe()} | {p.key.device}, {p.key.backend or '-'} | "
            f"{links or 'not measured (alone)'} |"
        )
    return lines


def _train_lines(out: Path) -> list[str]:
    lines = ["| run | device | P2P | losses | tokens/s (after step 1) |", "| --- | --- | --- | --- | ---: |"]
    for path in sorted((out / "train").glob("*.json")):
        m = _metrics(path)
        if m is None or "losses" not in m:
            continue
        losses = ", ".join(f"{x:.4f}" for x in m["losses"])
        lines.append(f"| {path.stem} | {m.get('device')} | {m.get('p2p')} | {losses} | {m['mean_tokens_per_s']:,.0f} |")
    for path in sorted((out / "train").glob("*_vs_*.json")):
        diff = _metrics(path)
        if diff is not None and "reference" in diff:
            lines += [
                "",
                f"{diff['run']} against {diff['reference']}: largest relative loss difference "
                f"{diff['max_rel_diff']:.2e} (tolerance {diff['rtol']:g}): "
                f"{'the same run' if diff['same'] else 'DIFFERENT'}.",
            ]
    return lines


HOST_STAGED_NOTE = """\
## What host-staged P2P does to these figures

NCCL refuses two ranks on one GPU, so every 2-rank step here runs over gloo, and gloo carries host memory
only. The runtime and `calibrate` therefore copy each pipeline tensor from the GPU to the host before a send and
from a host buffer to the GPU after a receive (`host-staged`); gloo's own CUDA all-reduce stages through pinned
host memory the same way. The links and syncs measured here include those copies and the loopback TCP of gloo:
they are this machine's figures for the CPU runtime on one GPU, far slower than NVLink or InfiniBand under
NCCL. Block (compute) times are the GPU's own. To predict a real multi-GPU Nanotron run, plan it with a profile
calibrated on that machine, one GPU per rank, over NCCL (`nanotron-ext calibrate --backend nccl` under torchrun).
"""


def summary(out: Path) -> int:
    """Write and print ``summary.md``; 1 when a step failed."""
    env = json.loads((out / "environment.json").read_text()) if (out / "environment.json").exists() else {}
    steps = _steps(out)
    failed = [s["name"] for s in steps if s["rc"] not in ("0", "skipped")]
    devices = ", ".join(env.get("devices", [])) or "no GPU"
    rehearsal = (
        [
            "**REHEARSAL on CPU (GPU_CHECK_REHEARSAL=1)**: the script's steps ran on CPU, `cuda` replaced by "
            "the CPU with host staging forced on; this checks the script, not a GPU.",
            "",
        ]
        if env.get("rehearsal")
        else []
    )
    text = "\n".join(
        [
            f"# GPU check on {devices}",
            "",
            *rehearsal,
            f"torch {env.get('torch')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}; flash-attn "
            f"{'installed (unused)' if env.get('flash_attn') else 'not installed'}: attention is torch SDPA. "
            f"Every 2-rank step: gloo, P2P host-staged.",
            "",
            f"Result: {'every step ok' if not failed else 'FAILED: ' + ', '.join(failed)}",
            "",
            "## Steps",
            "",
            *_step_table(steps),
            "",
            "## Machine profiles",
            "",
            *_profile_lines(out),
            "",
            "## Training on the GPU (the CPU runtime, NANOTRON_EXT_DEVICE=cuda; the seed model on CPU too)",
            "",
            *_train_lines(out),
            "",
            HOST_STAGED_NOTE,
        ]
    )
    (out / "summary.md").write_text(text)
    print(text)
    return 1 if failed or not steps else 0


def main(argv: list[str]) -> int:
    commands = {"env": environment, "configs": write_configs, "compare": compare, "summary": summary}
    extra = {"env": (0, 1), "compare": (0, 2)}.get(argv[0] if argv else "", (0,))
    if len(argv) < 2 or argv[0] not in commands or len(argv) - 2 not in extra:
        print(
            f"usage: python benchmarks/gpu_check.py {{{','.join(commands)}}} OUTDIR [REHEARSAL | RUN REFERENCE] "
            "(run benchmarks/gpu_check.sh)",
            file=sys.stderr,
        )
        return 2
    return commands[argv[0]](Path(argv[1]), *argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
