"""The default machine when no profile is given: a named analytic model of one H100 SXM per stage.

Where its numbers come from:

* **compute, 400 TFLOP/s** for every block: NVIDIA's H100 SXM datasheet gives 989 TFLOP/s dense bf16; Nanotron
  and Megatron-LM runs of Llama-sized models report 35–45 % model FLOP utilisation, so 40 % of peak. Real kernels
  do not all run at one rate (a thin lm_head is memory-bound), which is what ``calibrate`` measures.
* **p2p, 50 GB/s + 10 µs** between neighbouring stages: pipeline stages usually sit on different nodes (tensor
  parallelism fills a node's NVLink), linked by one 400 Gb/s InfiniBand NDR port per GPU (= 50 GB/s); a few µs of
  wire latency plus NCCL's launch, about 10 µs for a small p2p message.
* **gradient all-reduce, 50 GB/s bus bandwidth + 10 µs** for dp (and the tied embedding's all-reduce): the same
  NDR port, the ring's bus bandwidth in NCCL-tests' sense.
* **optimizer step, 3.0 TB/s of device memory**: NVIDIA's datasheet gives the H100 SXM's HBM3 3.35 TB/s; an
  elementwise pass such as fused AdamW's reaches about 90 % of it, so 3.0 TB/s. The step moves
  :func:`~nanotron_ext.costs.analytic.update_bytes` per trainable parameter (34 bytes in bf16 with fp32 masters).
* **device memory, 81,082 MiB** (79.18 GiB): what CUDA reports as the total of an H100 80GB HBM3
  (``torch.cuda.get_device_properties(0).total_memory``: 81,082 to 81,090 MiB in public logs, by driver).
  ``nvidia-smi`` shows 81,559 MiB; the driver reserves the rest. On this project's H200 (2026-11-26) nvidia-smi
  showed 143,771 MiB with 616 reserved, CUDA 143,156, and 142,612 MiB could be allocated as tensors: the CUDA
  context takes about 0.5 GiB, inside the estimate's overhead allowance.
* **engine overhead: 0** (not modelled; ``calibrate`` measures it).
"""

from __future__ import annotations

from nanotron_ext.machine.profile import Collective, Link, MachineProfile

__all__ = ["ANALYTIC_GPU", "H100_BF16_TFLOPS", "H100_HBM_BYTES_PER_S", "H100_MEMORY_BYTES", "IB_NDR_GBPS"]

#: Sustained training throughput assumed per GPU: 40 % of the H100 SXM's 989 TFLOP/s dense bf16 peak.
H100_BF16_TFLOPS = 400.0
#: One InfiniBand NDR port (400 Gb/s) per GPU, in GB/s.
IB_NDR_GBPS = 50.0
#: Device memory bandwidth an elementwise pass sustains: 90 % of the H100 SXM's 3.35 TB/s HBM3.
H100_HBM_BYTES_PER_S = 3.0e12
#: Device memory of an H100 80GB HBM3 as CUDA reports its total (the lowest figure seen: 81,082 MiB).
H100_MEMORY_BYTES = 81_082 * 2**20
#: Latency of one small NCCL p2p message or all-reduce step across nodes, seconds.
IB_LATENCY = 10e-6

ANALYTIC_GPU = MachineProfile(
    name="H100 SXM (analytic)",
    source=(
        "datasheet: 989 TFLOP/s dense bf16, 40 % of it sustained; stages on separate nodes over "
        "InfiniBand NDR (400 Gb/s = 50 GB/s, ~10 µs); optimizer step at 3.0 TB/s of HBM3 (90 % of 3.35); "
        "81,082 MiB of device memory (CUDA's total on an H100 80GB HBM3); "
        "see nanotron_ext/machine/analytic.py"
    ),
    flops_per_second=H100_BF16_TFLOPS * 1e12,
    links=(Link(-1, -1, IB_LATENCY, IB_NDR_GBPS * 1e9),),
    dp_allreduce=Collective(IB_LATENCY, IB_NDR_GBPS * 1e9),
    tied_allreduce=Collective(IB_LATENCY, IB_NDR_GBPS * 1e9),
    memory_bytes_per_second=H100_HBM_BYTES_PER_S,
    device_memory_bytes=H100_MEMORY_BYTES,
)
