"""The Nanotron adapter, the only code that touches Nanotron's model-building API: a drop-in
``build_model``, ``patch_nanotron()`` for Nanotron's own trainer, freezing on the built model, and the
collective check that every PP rank has a gradient."""

from nanotron_ext.errors import PipelineValidationError
from nanotron_ext.integration.adapter import (
    assign_blocks,
    build_model,
    patch_nanotron,
    patched_nanotron,
    pipeline_blocks,
    plan_for_model,
)
from nanotron_ext.integration.checks import apply_freeze_to_model, check_every_rank_trains

__all__ = [
    "PipelineValidationError",
    "apply_freeze_to_model",
    "assign_blocks",
    "build_model",
    "check_every_rank_trains",
    "patch_nanotron",
    "patched_nanotron",
    "pipeline_blocks",
    "plan_for_model",
]
