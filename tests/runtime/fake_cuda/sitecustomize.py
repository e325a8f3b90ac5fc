"""A GPU that torch believes is there (``tests/runtime/test_device.py``): on this path, a process sees one CUDA device
named "Fake GPU" and has none, so whatever picks CUDA because it is visible fails, and what follows the device rule
stays on the CPU that ``NANOTRON_EXT_DEVICE=cpu`` asks for."""

import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_name = lambda *args, **kwargs: "Fake GPU"
