"""Checkpoints across plans: the plan a checkpoint was trained with (saved beside Nanotron's files, with every file's
size and checksum), which folder a resume loads and whether it is whole, proof that its files are the ones the save
wrote, which plan the resume trains, and the mapping of the saved state onto another plan (another split, pp, tp,
dp, ZeRO-1 or number of vocabulary shards) with its proof of completeness.
"""

from nanotron_ext.checkpoint.digest import CHECKSUM, SavedFile
from nanotron_ext.checkpoint.load_failure import CheckpointLoadFailure, LoadFailure, load_failure_message
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
from nanotron_ext.checkpoint.verify import FileProblem, Verdict, instead_of, verify_checkpoint

__all__ = [
    "CHECKSUM",
    "LM_HEAD",
    "RECORD_FILE",
    "RESUME_PLANS",
    "CheckpointLoadFailure",
    "Difference",
    "FileProblem",
    "LoadFailure",
    "ModelKey",
    "Need",
    "PlanRecord",
    "ResumeChoice",
    "ResumeCount",
    "ResumePlan",
    "ResumeSource",
    "SavedCheckpoint",
    "SavedFile",
    "Verdict",
    "canonical_name",
    "check_same_model",
    "choose_plan",
    "count_placements",
    "instead_of",
    "kept_vocab_shards",
    "last_complete",
    "load_failure_message",
    "locate_checkpoint",
    "placement_problems",
    "read_record",
    "record_for",
    "verify_checkpoint",
    "vocab_shard_index",
]
