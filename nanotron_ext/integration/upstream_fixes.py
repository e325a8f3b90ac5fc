"""The upstream Nanotron bugs the launcher fixes, as records: what each is, how it is detected in the installed
source, and how it is fixed. Each fix is applied only where the installed Nanotron still has the bug, so an upstream
that fixed it gets nothing. ``docs/launcher.md`` lists them from these records (checked by a test).
"""

from __future__ import annotations

import inspect
import math
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["UPSTREAM_FIXES", "Patches", "UpstreamFix", "present_upstream_fixes"]


class Patches:
    """Attribute swaps that can all be undone, last first."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


@dataclass(frozen=True)
class UpstreamFix:
    """One upstream bug that stops runs, on GPUs too.

    Attributes:
        name: short name, as the docs list it.
        why: what the bug is and what it breaks (markdown, as ``docs/launcher.md`` shows it).
        detect: ``detect(trainer_module)`` is what to patch (a class) while the installed source has the bug,
            else None.
        apply: ``apply(patches, target)`` installs the fix on ``target``.
    """

    name: str
    why: str
    detect: Callable[[Any], Any]
    apply: Callable[[Patches, Any], None]


def present_upstream_fixes(trainer: Any) -> list[tuple[UpstreamFix, Any]]:
    """The fixes the installed Nanotron needs, each with what it patches (``trainer``: ``nanotron.trainer``)."""
    found = [(fix, fix.detect(trainer)) for fix in UPSTREAM_FIXES]
    return [(fix, target) for fix, target in found if target is not None]


# --- llama-random-init ---------------------------------------------------------------------------------------


def _detect_llama_init(trainer: Any) -> Any:
    llama = _import_or_none("nanotron.models.llama")
    if llama is not None and "parametrizator_cls(config=config.model)" in _source(
        llama.LlamaForTraining.init_model_randomly
    ):
        return llama.LlamaForTraining
    return None


def _fix_llama_init(patches: Patches, cls: type) -> None:
    original = cls.init_model_randomly

    def init_model_randomly(self: Any, config: Any) -> Any:
        # The method reads config.model.init_method, then hands config.model to a parametrizator that reads
        # .model.init_method and .parallelism: give it a view that answers both ways.
        view = _Either(config.model, config)
        return original(self, _Either(types.SimpleNamespace(model=view), config))

    patches.set(cls, "init_model_randomly", init_model_randomly)


# --- loss-log-on-pp-ranks ------------------------------------------------------------------------------------


def _detect_loss_log(trainer: Any) -> Any:
    logs = _source(getattr(trainer.DistributedTrainer, "train_step_logs", None))
    if re.search(r"(?<!\w)loss_avg\.item\(\)", logs) and not re.search(r"(?<!\w)loss_avg is not None", logs):
        return trainer.DistributedTrainer
    return None


def _fix_loss_log(patches: Patches, cls: type) -> None:
    original = cls.train_step_logs

    def train_step_logs(self: Any, outputs: Any, loss_avg: Any, *args: Any, **kwargs: Any) -> Any:
        # Ranks without the loss only build the log line; the logger ranks hold the loss and print it.
        if loss_avg is None:
            import torch

            loss_avg = torch.tensor(math.nan)
        return original(self, outputs, loss_avg, *args, **kwargs)

    patches.set(cls, "train_step_logs", train_step_logs)


# --- qwen2-pp -------------------------------------------------------------------------------------------------


def _detect_qwen2_pp(trainer: Any) -> Any:
    qwen = _import_or_none("nanotron.models.qwen")
    if "if position_ids.numel() > 0" in _source(getattr(getattr(qwen, "Qwen2Model", None), "forward", None)):
        return qwen.Qwen2Model
    return None


def _fix_qwen2_pp(patches: Patches, cls: type) -> None:
    from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

    original = cls.forward

    def forward(self: Any, input_ids: Any, position_ids: Any) -> Any:
        if not isinstance(position_ids, TensorPointer):
            return original(self, input_ids=input_ids, position_ids=position_ids)
        # The same walk over the blocks as upstream's, on a rank without the input: cu_seqlens, like
        # position_ids, lives on the input rank, so the blocks that need it receive it from there.
        output = self.token_position_embeddings(input_ids=input_ids, position_ids=position_ids)
        states = {
            "hidden_states": output["input_embeds"],
            "position_ids": output["position_ids"],
            "cu_seqlens": TensorPointer(group_rank=position_ids.group_rank),
        }
        for decoder_layer in self.decoder:
            states = decoder_layer(**states)
        hidden_states = self.final_layer_norm(input=states["hidden_states"])["hidden_states"]
        return self.lm_head(x=hidden_states)["logits"]

    patches.set(cls, "forward", forward)


# --- resume-without-folder-tokens -----------------------------------------------------------------------------


def _detect_resume_metadata(trainer: Any) -> Any:
    metadata = _import_or_none("nanotron.serialize.metadata")
    cls = getattr(metadata, "TrainingMetadata", None)
    return cls if "consumed_tokens_total == sum(" in _source(getattr(cls, "__post_init__", None)) else None


def _fix_resume_metadata(patches: Patches, cls: type) -> None:
    original = cls.__post_init__

    def post_init(self: Any) -> None:
        recorded = sum(stage.consumed_tokens_all_datasets for stage in (self.data_stages or []))
        if self.consumed_tokens_total and recorded == 0:
            # No loader recorded tokens per folder (dummy data, `datasets`): there is nothing to check against.
            total, self.consumed_tokens_total = self.consumed_tokens_total, None
            original(self)
            self.consumed_tokens_total = total
        else:
            original(self)

    patches.set(cls, "__post_init__", post_init)


#: The upstream bugs the launcher carries a fix for, in the order they are applied.
UPSTREAM_FIXES: tuple[UpstreamFix, ...] = (
    UpstreamFix(
        "llama-random-init",
        "`LlamaForTraining.init_model_randomly` hands `config.model` to the parametrizator, which reads "
        "`config.model.init_method`: a Llama cannot be initialised",
        _detect_llama_init,
        _fix_llama_init,
    ),
    UpstreamFix(
        "loss-log-on-pp-ranks",
        "`train_step_logs` calls `loss_avg.item()` on every rank; `loss_avg` is None on PP ranks without the "
        "loss: pp > 1 stops at the first log",
        _detect_loss_log,
        _fix_loss_log,
    ),
    UpstreamFix(
        "qwen2-pp",
        "`Qwen2Model.forward` calls `position_ids.numel()` on every rank; a rank without the input holds a "
        "`TensorPointer`: Qwen2 with pp > 1 stops at the first step",
        _detect_qwen2_pp,
        _fix_qwen2_pp,
    ),
    UpstreamFix(
        "resume-without-folder-tokens",
        "`TrainingMetadata` checks consumed tokens against a per-folder count only the Nanoset loader records: "
        "a checkpoint from dummy data or `datasets` cannot be resumed",
        _detect_resume_metadata,
        _fix_resume_metadata,
    ),
)


class _Either:
    """Attribute lookup in ``first``, then ``second``."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def __getattr__(self, name: str) -> Any:
        return getattr(self.first, name) if hasattr(self.first, name) else getattr(self.second, name)


def _import_or_none(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj) if obj is not None else ""
    except (OSError, TypeError):
        return ""
