"""Published peak figures of the GPUs the roofline projection and MFU refer to (dense, no
sparsity, boost clock, NVIDIA data sheets)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    match: str  # substring of torch.cuda.get_device_name()
    fp32: float  # FLOP/s, CUDA cores
    half: float  # FLOP/s, 16-bit matmul (tensor cores from V100 on; P100: packed fp16)
    half_dtype: str
    bandwidth: float  # bytes/s, HBM


GPUS = (
    GPU("P100 SXM2 16GB", "P100", 10.6e12, 21.2e12, "fp16", 732e9),
    GPU("V100 SXM2 32GB", "V100", 15.7e12, 125e12, "fp16", 900e9),
    GPU("A100 SXM4 80GB", "A100", 19.5e12, 312e12, "bf16", 2039e9),
    GPU("H100 SXM5 80GB", "H100", 67e12, 989e12, "bf16", 3350e9),
    GPU("H200 SXM 141GB", "H200", 67e12, 989e12, "bf16", 4800e9),
)
