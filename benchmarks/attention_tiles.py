"""Registers, spills and tensor-core instructions of the attention kernels for each feature set
the model launches, at candidate tile sizes, for sm_80 and sm_90 (or any --arch): the evidence
for choosing tiles per variant and per GPU family (issue 49 item 2; kernels.attention.launch_tile).
Compiles only (no GPU); about 3 s per compilation on one core the first time (Triton caches them).

    python -m benchmarks.attention_tiles [--kernel _attn_bwd_dkdv] [--head-dim 64] [--json PATH]
    python -m benchmarks.attention_tiles --kernel _attn_fwd --head-dim 256 --tile 32 32 4 2
    python -m benchmarks.attention_tiles --shipped --variant causal   # the launchers' tiles only
    python -m benchmarks.attention_tiles --shipped --seed-pointers    # dropout seeds via pointers

Prints one line per (kernel, head dim, dtype, variant, tile, arch).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import multiprocessing
from dataclasses import asdict

import torch

from fastattn.kernels import attention
from fastattn.kernels.compile_report import compile_config, seeds_through_pointers

# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates besides the shipped one for the head dim
# and architecture, which is tried first.
TILES = {
    "_attn_fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3)],
    "_attn_bwd_dkdv": [(64, 32, 8, 2), (32, 64, 4, 2), (64, 64, 4, 2), (32, 128, 8, 2),
                       (64, 128, 8, 2)],
    "_attn_bwd_dq": [(128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3),
                     (64, 32, 8, 3)],
}
# --dtype names: (dtype, products' precision). fp32 compiles its products in tf32, as fp32 inputs
# run with torch's allow_tf32 on (tensor cores); fp32-exact in IEEE float32, as they run by
# default (FMA loops).
DTYPES = {"fp16": (torch.float16, "tf32"), "bf16": (torch.bfloat16, "tf32"),
          "fp32": (torch.float32, "tf32"), "fp32-exact": (torch.float32, "ieee")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--kernel", nargs="+", default=list(TILES), choices=list(TILES))
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", nargs="+", default=["fp16", "bf16"], choices=list(DTYPES))
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--variant", nargs="+", default=list(attention.VARIANTS),
                        choices=list(attention.VARIANTS))
    parser.add_argument("--tile", type=int, nargs=4, action="append", metavar=("M", "N", "W", "S"),
                        help="try this (BLOCK_M, BLOCK_N, warps, stages) instead of the list")
    parser.add_argument("--shipped", action="store_true",
                        help="only the tile the launchers pick (kernels/attention.launch_tile)")
    parser.add_argument("--seed-pointers", action="store_true",
                        help="only the variants with dropout, their seeds read through pointers "
                             "(fastattn.ops.seeds.from_device, for CUDA graphs)")
    parser.add_argument("--json", help="also write the rows as JSON")
    parser.add_argument("--jobs", type=int, default=1, help="compile on this many processes")
    args = parser.parse_args(argv)
    variants = [v for v in args.variant
                if attention.VARIANTS[v][3] or not args.seed_pointers]  # [3]: dropout
    work = []
    for name in args.kernel:
        for d, dtype, variant, arch in itertools.product(args.head_dim, args.dtype, variants,
                                                          args.arch):
            tiles = [] if args.shipped else [tuple(t) for t in args.tile] if args.tile \
                else TILES[name]
            shipped = attention.launch_tile(name, d, DTYPES[dtype][0], arch,
                                            **attention.tile_variant(*attention.VARIANTS[variant]),
                                            precision=DTYPES[dtype][1])
            work += [(name, d, dtype, variant, tile, arch, args.seed_pointers)
                     for tile in dict.fromkeys([shipped, *tiles])]
    if args.jobs <= 1:
        rows = [compile_tile(*item) for item in work]
    else:
        context = multiprocessing.get_context("spawn")  # fresh interpreters, as compile_report
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            rows = list(pool.map(compile_tile, *zip(*work, strict=True)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def compile_tile(name, d, dtype, variant, tile, arch, seed_pointers=False) -> dict:
    """Compiles one (kernel, head dim, dtype, variant, tile) for arch (seed_pointers: its dropout
    seeds read through pointers); prints, returns its row."""
    fn = getattr(attention, name)
    mask, key, causal, dropout = attention.VARIANTS[variant]
    block_m, block_n, warps, stages = tile
    config = dict(
        name=f"{name} d={d} {dtype} {variant} {tile}", fn=fn,
        signature=attention._kernel_signature(fn, dtype.removesuffix("-exact"), mask, d),
        constexprs=dict(HEAD_DIM=d, BLOCK_D=d, BLOCK_M=block_m, BLOCK_N=block_n, MASK_KIND=mask,
                        KEY_MASK=key, CAUSAL=causal, DROPOUT=dropout,
                        DOT_PRECISION=DTYPES[dtype][1]),
        num_warps=warps, num_stages=stages)
    if seed_pointers:
        config = seeds_through_pointers(config)
    result = compile_config(attention.__name__, config, arch)
    matmul = "wgmma" if result.wgmma else "mma" if result.mma else "-"
    print(f"{result.name:<60} sm_{arch}  regs {result.registers:>3}  spill "
          f"{result.spill_bytes:>5}  {matmul}", flush=True)
    return asdict(result)

if __name__ == "__main__":
    main()
