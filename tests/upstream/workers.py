"""Functions run inside spawned ranks by ``test_upstream_patch.py`` (see ``tests/runtime/spawn.py``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `upstream.harness` in a child process


def build_through_patched_trainer(config_path: str, strategy: str | None) -> dict[str, Any]:
    """Build upstream's ``LlamaForTraining`` through the ``build_model`` name ``nanotron.trainer`` holds, after
    ``patch_nanotron``; report which blocks this rank built (or the error, and whether anything was built)."""
    import nanotron.trainer
    import torch
    from nanotron.config import get_config_from_file
    from nanotron.models.llama import LlamaForTraining
    from nanotron.parallel import ParallelContext
    from nanotron.parallel.pipeline_parallel.block import PipelineBlock

    from nanotron_ext import NanotronExtError, load_config
    from nanotron_ext.integration import patch_nanotron
    from upstream.harness import cuda_to

    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    ParallelContext.set_device = lambda self: None  # test-side stand-in: no GPU to select
    cfg = load_config(config_path)
    nanotron_cfg = get_config_from_file(config_path, skip_unused_config_keys=True)  # drops our section
    ctx = ParallelContext(tensor_parallel_size=1, pipeline_parallel_size=cfg.run.pp, data_parallel_size=1)
    built: list[Any] = []

    def builder():
        built.append(
            LlamaForTraining(
                config=nanotron_cfg.model.model_config,
                parallel_context=ctx,
                parallel_config=nanotron_cfg.parallelism,
                random_states=None,
            )
        )
        return built[-1]

    rank = torch.distributed.get_rank(ctx.pp_pg)
    undo = patch_nanotron(cfg, strategy)
    try:
        with cuda_to("cpu"):
            model = nanotron.trainer.build_model(
                model_builder=builder, parallel_context=ctx, dtype=torch.float32, device=torch.device("cpu")
            )
    except NanotronExtError as exc:
        blocks = [b for _, b in built[0].named_modules() if isinstance(b, PipelineBlock)]
        return {"error": str(exc), "anything_built": any(hasattr(b, "pp_block") for b in blocks)}
    finally:
        undo()
        torch.distributed.destroy_process_group()
    return {
        "rank": rank,
        "plan_ranks": list(model.nanotron_ext_plan.block_ranks),
        "built": [name for name, b in model.named_modules() if isinstance(b, PipelineBlock) and hasattr(b, "pp_block")],
        "names": [name for name, b in model.named_modules() if isinstance(b, PipelineBlock)],
        "params": sum(p.numel() for p in model.parameters()),
        "output_pp_rank": model.output_pp_rank,
    }


def gloo_context_groups(pp: int) -> dict[str, Any]:
    """The CPU runtime's gloo context on upstream main: its groups' sizes and this rank's coordinates."""
    import torch

    from nanotron_ext.runtime import GlooParallelContext

    with GlooParallelContext(tensor_parallel_size=1, pipeline_parallel_size=pp, data_parallel_size=2 // pp) as ctx:
        return {
            "sizes": {g: ctx.__getattribute__(g).size() for g in ("tp_pg", "pp_pg", "dp_pg", "cp_pg", "world_pg")},
            "matrix_shape": list(ctx.world_rank_matrix.shape),
            "pp_rank": torch.distributed.get_rank(ctx.pp_pg),
        }
