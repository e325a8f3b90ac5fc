"""Upstream Nanotron's own ``run_train.py`` and ``DistributedTrainer`` run through ``python -m nanotron_ext.run
--cpu-debug`` on CPU, as a user runs them on a laptop: two torchrun workers over gloo, dummy data (``dataset: null``),
the package's CPU stand-ins (:mod:`nanotron_ext.integration.cpu_standins`) and nothing of the test pass's shim (only
a test fault puts ``tests/upstream_stubs`` on the ranks' path). Configs are upstream's own example YAMLs, shrunk to CPU
size."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from nanotron_cpu import PAUSE_IN_SAVE
from torchrun_summary import no_traceback_of_ours, root_cause

from nanotron_ext.integration.cpu_standins import FLAG as CPU_DEBUG_FLAG
from nanotron_ext.procs import local_env, run_local_ranks
from upstream.harness import UPSTREAM_EXAMPLES, upstream_tree

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "tests" / "upstream_stubs"
SEED_VOCAB = 50277  # the seed case: a tiny model with GPT-NeoX's vocabulary


def tiny_config(
    tmp: Path,
    example: str = "config_tiny_llama.yaml",
    *,
    steps: int = 10,
    pp: int = 2,
    ext: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Upstream's example YAML shrunk to CPU size (hidden 16, 2 layers, vocab 50277, fp32, seq 32), with
    our section ``ext`` and dotted ``overrides`` (``checkpoints__save_initial_state=True``)."""
    d = yaml.safe_load((UPSTREAM_EXAMPLES / example).read_text())
    d["model"]["model_config"].update(
        hidden_size=16,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=SEED_VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    d["model"]["model_config"].pop("moe_config", None)
    d["model"].update(dtype="float32", init_method={"std": 0.5})
    d["parallelism"].update(
        dp=1,
        pp=pp,
        tp=1,
        pp_engine="1f1b",
        tp_mode="ALL_REDUCE",
        tp_linear_async_communication=False,
        context_parallel_size=1,
        expert_parallel_size=1,
    )
    d["tokens"].update(
        micro_batch_size=4, sequence_length=32, train_steps=steps, batch_accumulation_per_replica=2, limit_val_batches=0
    )
    d["optimizer"].update(accumulate_grad_in_fp32=False, zero_stage=0, clip_grad=1.0, weight_decay=0.01)
    d["optimizer"]["optimizer_factory"].update(name="adamW", torch_adam_is_fused=False)
    d["optimizer"]["learning_rate_scheduler"].update(
        learning_rate=0.02, min_decay_lr=0.02, lr_warmup_steps=1, lr_warmup_style="linear", lr_decay_steps=None
    )
    d["checkpoints"].update(
        checkpoints_path=str(tmp / "checkpoints"),
        checkpoint_interval=steps,
        save_initial_state=False,
        resume_checkpoint_path=None,
    )
    d["general"].update(benchmark_csv_path=None, seed=42)
    for stage in d["data_stages"]:
        stage["data"]["dataset"] = None
    d.pop("lighteval", None)
    d["profiler"] = None  # upstream's example profiles 6 steps; not under test
    d.pop("s3_upload", None)
    for dotted, value in overrides.items():
        *path, key = dotted.split("__")
        node = d
        for part in path:
            node = node.setdefault(part, {})
        node[key] = value
    if ext is not None:
        d["nanotron_ext"] = ext
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


@dataclass
class Run:
    rc: int
    out: str

    @property
    def losses(self) -> dict[int, float]:
        """Step -> logged lm_loss (upstream logs 3 significant digits)."""
        return {int(s): float(v) for s, v in re.findall(r"iteration: (\d+) / \d+ .*?\| lm_loss: ([0-9.]+)", self.out)}


def torchrun_command(
    config: Path, *launcher_args: str, nproc: int = 2, extra_env: dict[str, str] | None = None, cpu_debug: bool = True
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of ``torchrun --nproc_per_node=N -m nanotron_ext.run --cpu-debug [ARGS] run_train.py
    --config-file CONFIG``: upstream's own trainer on CPU, as the docs tell a user to run it (``cpu_debug=False``
    leaves the flag out). The ranks' ``PYTHONPATH`` has the project first and not the test pass's shim
    (``tests/upstream_stubs``), unless ``extra_env`` asks for its test fault (``nanotron_cpu.PAUSE_IN_SAVE``)."""
    env = local_env(ROOT, **(extra_env or {}))
    paths = [p for p in env["PYTHONPATH"].split(os.pathsep) if p and Path(p).resolve() != STUBS]
    env["PYTHONPATH"] = os.pathsep.join([str(STUBS), *paths] if PAUSE_IN_SAVE in (extra_env or {}) else paths)
    run_train = upstream_tree() / "run_train.py"  # skips (or fails, NANOTRON_EXT_REQUIRE_SHARED=1) without it
    flag = [CPU_DEBUG_FLAG] if cpu_debug else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "nanotron_ext.run",
        *flag,
        *launcher_args,
        str(run_train),
        "--config-file",
        str(config),
    ]
    return cmd, env


#: Seconds the other ranks of a direct launch (``torchrun=False``) may run on after one fails.
DIRECT_GRACE_S = 15.0
#: Tests of what a run trains and saves start their ranks directly (``launch(..., torchrun=TORCHRUN)``); the
#: launcher's own path through torchrun keeps tests of its own (its refusals, ``test_cpu_debug.py``, the faults, a
#: training of the seed model). NANOTRON_EXT_TEST_TORCHRUN=1 puts torchrun back under every one.
TORCHRUN = os.environ.get("NANOTRON_EXT_TEST_TORCHRUN") == "1"


def launch(
    config: Path,
    *launcher_args: str,
    nproc: int = 2,
    timeout: float = 240,
    cpu_debug: bool = True,
    torchrun: bool = True,
) -> Run:
    """Run :func:`torchrun_command` to its end (at most ``timeout`` seconds).

    ``torchrun=False`` starts the ranks directly instead, with the environment torchrun gives them
    (``nanotron_ext.procs.run_local_ranks``), their outputs one after the other in rank order: for tests of what a
    run trains and saves, not of how torchrun runs it. It saves torchrun's agent and rendezvous, about 2 s and 2 s of
    CPU a launch (measured: a 2-rank gloo barrier takes 4.0-4.5 s under torchrun, 2.1 s direct), which the resume
    tests pay some 30 times. The exit code is the first failed rank's (1 for one killed after a peer failed).
    """
    cmd, env = torchrun_command(config, *launcher_args, nproc=nproc, cpu_debug=cpu_debug)
    if not torchrun:
        direct = [sys.executable, *cmd[cmd.index("-m", 3) :]]  # `python -m nanotron_ext.run ...`, torchrun's args gone
        from runtime.forkserver import start

        ranks = run_local_ranks(
            direct,
            nproc,
            timeout=timeout,
            env=env,
            merge_output=True,
            cwd=config.parent,
            grace=DIRECT_GRACE_S,
            start=start,
        )
        if ranks.deadline_hit:
            raise subprocess.TimeoutExpired(direct, timeout, "".join(r.stdout for r in ranks.ranks))
        code = next((1 if r.returncode is None else r.returncode for r in ranks.ranks if r.returncode != 0), 0)
        return Run(code, "".join(r.stdout for r in ranks.ranks))
    # torchrun in its own session: at the deadline its workers are killed with it (subprocess.run's timeout
    # would kill torchrun alone).
    run = run_local_ranks(cmd, 1, timeout=timeout, env=env, rendezvous=False, merge_output=False, cwd=config.parent)
    only = run.ranks[0]
    if only.killed:
        raise subprocess.TimeoutExpired(cmd, timeout, only.stdout, only.stderr)
    return Run(only.returncode, only.stdout + only.stderr)


def one_message(out: str, text: str, code: int) -> None:
    """Under torchrun, our error starting with ``text`` (after ``nanotron_ext.run [rank R]: ``) is printed once, by
    one rank; every rank wrote it to its torchelastic error file, which torchrun's summary shows (its root cause with
    exit code ``code``); no traceback is ours (cli.md#one-job-one-message)."""
    head = r"nanotron_ext\.run \[rank (\d)\]: " + re.escape(text)
    assert len(re.findall("^" + head, out, re.M)) == 1, out[-4000:]
    assert set(re.findall("traceback : " + head, out)) == {"0", "1"}, out[-4000:]
    root = root_cause(out, code)  # the rank whose report came first
    assert "traceback : nanotron_ext.run [rank" in root, root
    no_traceback_of_ours(out)


def whole_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Each saved parameter of a checkpoint folder as one whole tensor: tensor-parallel shards and vocabulary shards
    put together by the slices in their headers, read with Nanotron's own ``SlicesPair`` (the reference for what the
    launcher's loader reads)."""
    from nanotron.parallel.parameters import SlicesPair
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted((checkpoint / "model").rglob("*.safetensors")):
        rel = f.relative_to(checkpoint / "model")
        name = ".".join([*rel.parts[:-1], re.sub(r"(_pp-rank-.*)?\.safetensors$", "", rel.name[len("model_") :])])
        with safe_open(str(f), "pt") as fi:
            tensor, meta = fi.get_tensor("data"), fi.metadata() or {}
        if "unsharded_shape" not in meta:
            out[name] = tensor
            continue
        whole = out.setdefault(
            name,
            torch.full(
                tuple(int(x) for x in re.findall(r"\d+", meta["unsharded_shape"])), float("nan"), dtype=tensor.dtype
            ),
        )
        for pair in SlicesPair.tuple_from_str(meta["local_global_slices_pairs"]):
            whole[pair.global_slices] = tensor[pair.local_slices]
    assert not any(t.isnan().any() for t in out.values() if t.is_floating_point()), "a part of a weight is missing"
    return out


def weight_digests(checkpoint: Path) -> dict[str, str]:
    """SHA-256 of the tensor bytes of each saved weight of a checkpoint folder, keyed by its file's path below
    ``model/`` (the files' headers carry sharding metadata that may differ between saves of equal weights)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted((checkpoint / "model").rglob("*.safetensors")):
        digest = hashlib.sha256()
        for name, tensor in sorted(load_file(f).items()):
            digest.update(name.encode() + tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        out[str(f.relative_to(checkpoint / "model"))] = digest.hexdigest()
    return out
