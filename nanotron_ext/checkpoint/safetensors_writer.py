"""A safetensors file written from the tensors' own memory through any binary file (a hashing one, here).

``safetensors.torch.save_file`` writes from Rust straight to a path, so no byte of it can be hashed on its way;
its ``save`` returns the whole file as ``bytes`` (measured: twice the file's size in extra memory while it
writes). This writer streams the same format instead: an 8-byte little-endian header length, the JSON header
padded with spaces to a multiple of 8 bytes, then each tensor's bytes in the header's order, with no copy of a
CPU tensor. For one tensor (what Nanotron saves) and at most one metadata entry its bytes are safetensors' own,
byte for byte (``tests/test_checkpoint_files.py``); with more metadata entries only their order differs (safetensors
orders them by hash).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

__all__ = ["SAFETENSORS_DTYPES", "write_safetensors"]

#: torch dtype -> safetensors' name for it.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def write_safetensors(out: Any, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (and the string ``metadata``) to the binary file ``out`` in safetensors format; returns the
    bytes written.

    Raises:
        TypeError: a tensor's dtype has no safetensors name.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset, parts = 0, []
    # safetensors orders tensors by alignment, then name: the largest elements first keeps each one aligned.
    for name in sorted(tensors, key=lambda k: (-tensors[k].element_size(), k)):
        tensor = tensors[name].detach().cpu().contiguous()
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{name}: safetensors has no dtype for {tensor.dtype}")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        parts.append(tensor)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out.write(struct.pack("<Q", len(text)))
    out.write(text)
    for tensor in parts:
        if tensor.numel():
            out.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return 8 + len(text) + offset
