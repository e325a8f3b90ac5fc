"""gpu_check's launcher step (issue 41): upstream Nanotron main's own ``run_train.py`` through ``python -m
nanotron_ext.run`` on CUDA, world 1 over NCCL: the launcher's GPU path, run for the first time.

flash-attn is not installed on the lent GPU machines. As ``gpu_path_memory.py`` does, its import stand-ins
(``nanotron_ext/integration/cpu_standins/missing_modules``, put *after* the installed packages, so a real flash-attn
or Triton wins) let upstream import, and ``_flash_memory.install()`` puts kernels that keep what flash-attn's keep in
place of the three upstream's Llama calls in training. Everything else is upstream's trainer on the GPU: its NCCL
``ParallelContext``, its optimizer, its checkpoint, with our plan, freezing, gradient check and checkpoint record.

The run: ``examples/cpu_debug/train_pp2.yaml`` (a tiny Llama, 4 steps, dummy data, upstream's clipping) at pp=1,
its checkpoint in ``OUTDIR/checkpoints``; then the checkpoint's record is read back and its files proved (what a
resume checks). ``--cpu-debug`` rehearses the same on CPU over gloo (the launcher's own flag: the stand-ins first).

Usage, from the project's root, upstream Nanotron importable::

    torchrun --standalone --nproc_per_node=1 benchmarks/gpu_launcher.py RUN_TRAIN OUTDIR [--cpu-debug]

Exit status: the launcher's (0 when it trained and saved), 1 when the checkpoint is missing or does not verify.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "cpu_debug" / "train_pp2.yaml"


def write_config(out: Path) -> Path:
    """The example at pp=1 (world 1), every block on the one stage, its checkpoints under ``out``."""
    raw = yaml.safe_load(CONFIG.read_text())
    raw["parallelism"]["pp"] = 1
    raw["nanotron_ext"] = {"cost_strategy": "constrained"}
    raw["checkpoints"]["checkpoints_path"] = str(out / "checkpoints")
    raw["checkpoints"]["checkpoint_interval"] = raw["tokens"]["train_steps"]
    path = out / "gpu_launcher.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_train", help="upstream Nanotron's run_train.py")
    parser.add_argument("out", help="where the config and the checkpoint go")
    parser.add_argument("--cpu-debug", action="store_true", help="rehearse on CPU over gloo (the launcher's flag)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = write_config(out)
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    if not args.cpu_debug:
        from nanotron_ext.integration.cpu_standins import MISSING_MODULES

        sys.path.append(str(MISSING_MODULES))  # after the installed packages: flash-attn's import stand-ins
        import _flash_memory

        _flash_memory.install()  # kernels that keep what flash-attn's keep, on CUDA

    from nanotron_ext.run import main as launch

    code = launch([*(["--cpu-debug"] if args.cpu_debug else []), args.run_train, "--config-file", str(config)])
    if code != 0:
        return code
    return _check_checkpoint(out / "checkpoints")


def _check_checkpoint(folder: Path) -> int:
    """The last checkpoint's record read back and its files proved, as a resume does."""
    from nanotron_ext.checkpoint import locate_checkpoint
    from nanotron_ext.checkpoint.verify import verify_checkpoint

    try:
        found = locate_checkpoint(str(folder))
        verdict = None if found is None else verify_checkpoint(found)
    except Exception as exc:  # a half-written, unreadable or damaged checkpoint: the check's finding
        print(f"gpu_launcher: the checkpoint under {folder} does not verify: {exc}", file=sys.stderr)
        return 1
    if found is None or verdict is None or not verdict.verified:
        print(f"gpu_launcher: no checkpoint under {folder} whose files its record proves", file=sys.stderr)
        return 1
    print(f"gpu_launcher: trained through the launcher and saved {found.label}, {verdict.files} files proved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
