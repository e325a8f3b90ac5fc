"""Torch model code: the CPU runtime's Llama (``llama``), the standalone modules the ``profiled`` strategy times
(``profiled_blocks``) and the vocabulary-shard chain (``vocab_chain``).

Nanotron's block API and torch only; nothing here plans. Import the submodules directly: they import torch and
Nanotron, which the planner does not need.
"""
