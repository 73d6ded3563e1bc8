"""Tries Triton 3.9's automatic warp specialisation (the loop that TMA loads make eligible:
tl.range(..., warp_specialize=True)) on the descriptor forward for sm_90: writes a copy of
attn_fwd_tma.py with the key loop so marked (the unchecked loop only: WS = not CHECK_BOUNDS) to
/tmp/tma_ws/ and compiles it at 4 and 8 warps.
Seen here: 4 warps -> the NVGPUWarpSpecialization pass fails (an MLIR dominance assertion for the
device-side descriptors; "descriptor block and tensor must have the same number of elements"
for the rank-4 host ones); 8 warps -> compiles, but the SASS is the unspecialised kernel's
(the same registers and instruction counts: the pass leaves it alone).

    .venv/bin/python experiments/tma_forward/try_warp_specialize.py   # from the repo root
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = "/tmp/tma_ws"
os.makedirs(OUT, exist_ok=True)
with open(os.path.join(HERE, "attn_fwd_tma.py")) as f:
    src = f.read()
old = "    for start_n in range(lo, hi, BLOCK_N):\n"
assert old in src
src = src.replace(old, "    WS: tl.constexpr = not CHECK_BOUNDS\n"
                       "    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):\n")
with open(os.path.join(OUT, "attn_fwd_tma_ws.py"), "w") as f:
    f.write(src)
sys.path[:0] = [OUT, ROOT]

import attn_fwd_tma_ws  # noqa: E402

from experiments.tma_forward import attn_fwd_tma  # noqa: E402
from experiments.tma_forward import compile_compare as cc  # noqa: E402

attn_fwd_tma._attn_fwd_tma = attn_fwd_tma_ws._attn_fwd_tma
attn_fwd_tma._attn_fwd_tma_dev = attn_fwd_tma_ws._attn_fwd_tma_dev
for kernel in ("tma-host", "tma-dev"):
    for d, tile, variant in [(64, (128, 64, 4, 3), "causal"), (64, (128, 64, 8, 3), "causal"),
                             (128, (128, 64, 4, 2), "key padding")]:
        print(cc.fmt(cc.compile_one(kernel, d, "fp16", variant, tile))[:300], flush=True)
