"""Checkpoints across plans: the plan a checkpoint was trained with (saved beside Nanotron's files), which folder a
resume loads and whether it is whole, which plan the resume trains, and the mapping of the saved state onto
another plan (another split, pp, tp, dp, ZeRO-1 or number of vocabulary shards) with its proof of completeness.
"""

from nanotron_ext.checkpoint.locate import ResumeSource, last_complete, locate_checkpoint
from nanotron_ext.checkpoint.placement import Need, ResumeCount, count_placements, placement_problems
from nanotron_ext.checkpoint.record import (
    RECORD_FILE,
    Difference,
    ModelKey,
    PlanRecord,
    read_record,
    record_for,
)
from nanotron_ext.checkpoint.resume import (
    RESUME_PLANS,
    ResumeChoice,
    ResumePlan,
    check_same_model,
    choose_plan,
    kept_vocab_shards,
)
from nanotron_ext.checkpoint.saved import LM_HEAD, SavedCheckpoint, canonical_name, vocab_shard_index

__all__ = [
    "LM_HEAD", "RECORD_FILE", "RESUME_PLANS", "Difference", "ModelKey", "Need", "PlanRecord", "ResumeChoice",
    "ResumeCount", "ResumePlan", "ResumeSource", "SavedCheckpoint", "canonical_name", "check_same_model",
    "choose_plan", "count_placements", "kept_vocab_shards", "last_complete", "locate_checkpoint",
    "placement_problems", "read_record", "record_for", "vocab_shard_index",
]
