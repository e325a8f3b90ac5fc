"""``patch_nanotron`` is all or nothing, against whichever Nanotron is installed (0.2 or upstream main)."""

from __future__ import annotations

import importlib
import importlib.abc
import sys

import nanotron.models
import nanotron.models.base
import pytest

from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.errors import NanotronExtError
from nanotron_ext.integration import adapter, build_model, patch_nanotron


def _trainer():
    try:
        return importlib.import_module("nanotron.trainer")
    except ImportError:  # 0.2 on a CPU machine: it imports flash_attn
        return None


def test_patch_swaps_every_build_model_name_and_undo_restores_them():
    originals = (nanotron.models.base.build_model, nanotron.models.build_model)
    trainer = _trainer()
    trainer_original = trainer.build_model if trainer is not None else None
    undo = patch_nanotron(load_config(bundled_config()))
    try:
        assert nanotron.models.base.build_model is build_model and nanotron.models.build_model is build_model
        if trainer is not None:  # upstream main with the import stand-ins: the name its trainer calls
            assert trainer.build_model is build_model
    finally:
        undo()
    assert (nanotron.models.base.build_model, nanotron.models.build_model) == originals
    assert trainer is None or trainer.build_model is trainer_original
    assert not adapter._ACTIVE


class _FailingTrainer(importlib.abc.MetaPathFinder):
    """Makes `import nanotron.trainer` fail as upstream's does without grouped_gemm (RuntimeError, not ImportError)."""

    def find_spec(self, name, path, target=None):
        if name == "nanotron.trainer":
            raise RuntimeError("Grouped GEMM is not available. Please run `pip install grouped_gemm`")
        return None


def test_a_failing_import_leaves_nothing_patched(monkeypatch):
    originals = (nanotron.models.base.build_model, nanotron.models.build_model)
    monkeypatch.delitem(sys.modules, "nanotron.trainer", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingTrainer(), *sys.meta_path])
    with pytest.raises(
        NanotronExtError,
        match=r"^patch_nanotron: importing nanotron.trainer failed \(RuntimeError: "
        r"Grouped GEMM is not available.*\), so nothing was patched\. Install",
    ):
        patch_nanotron(load_config(bundled_config()))
    assert (nanotron.models.base.build_model, nanotron.models.build_model) == originals
    assert not adapter._ACTIVE
