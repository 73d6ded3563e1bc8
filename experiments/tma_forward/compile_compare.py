"""Side-by-side sm_90 compile of the shipped forward (kernels/attention.py _attn_fwd) and the
tensor-descriptor forwards of experiments/tma_forward/attn_fwd_tma.py, for the model's training
variants without dropout (key padding; causal), head dims 64 and 128, fp16 and bf16. No GPU
needed.

Per row: registers, spill bytes (cuobjdump), shared memory (Triton metadata), wgmma (PTX),
TMA (PTX cp.async.bulk.tensor / SASS UTMALDG, UTMASTG), cp.async (LDGSTS) and plain global
loads (LDG) in SASS, total SASS instructions and the instructions of the loops (backward
branches in the SASS: each loop's size, largest first; the kernel has two key loops, the
unchecked one and the bounds/causal one, plus the pipeliner's prologue/epilogue outside them).

From the repository root (or `python -m experiments.tma_forward.compile_compare ...`):

    .venv/bin/python experiments/tma_forward/compile_compare.py [--jobs 2] \
        [--json experiments/tma_forward/compile_compare.json] [--quick]

TMA_DUMP=<folder> also writes every row's PTX and SASS there.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import itertools
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run by path (and in the spawned workers): experiments.*, fastattn
    sys.path.insert(0, ROOT)

VARIANTS = {"key padding": (1, True, False), "causal": (0, False, True)}  # MASK_KIND, KEY, CAUSAL
KERNELS = ("shipped", "tma-host", "tma-host-ptrO", "tma-dev")
# (BLOCK_M, BLOCK_N, warps, stages); the shipped sm_90 tile (launch_tile) is added first.
CANDIDATES = {
    64: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
         (128, 64, 4, 3), (64, 64, 4, 3)],
    128: [(64, 32, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3),
          (128, 128, 8, 2)],
}
SMEM_LIMIT = 232448  # H100 per-block opt-in maximum (227 KB)


def _bin(tool):
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def _sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_bin("cuobjdump"), "-sass", f.name], check=True,
                              capture_output=True, text=True).stdout


def _resource_usage(cubin: bytes):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", f.name], check=True,
                               capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    spill = int(re.search(r"STACK:(\d+)", usage).group(1)) + int(
        re.search(r"LOCAL:(\d+)", usage).group(1))
    return regs, spill


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def sass_stats(sass: str) -> dict:
    """Instruction counts and loop sizes from cuobjdump -sass text."""
    instrs = []  # (address, text)
    for m in _INSTR.finditer(sass):
        instrs.append((int(m.group(1), 16), m.group(2).strip()))
    loops = []
    # Out-of-line blocks after the last EXIT (mbarrier try-wait retries, which branch back into
    # the body, and the final self-branch) are not loops of the kernel's code.
    last_exit = max((a for a, t in instrs if re.search(r"\bEXIT\b", t)), default=1 << 62)
    for addr, text in instrs:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and addr < last_exit:
            target = int(m.group(1), 16)
            if target < addr:  # a backward branch closes a loop [target, addr]
                body = [t for a, t in instrs if target <= a <= addr]
                loops.append(body)
    ops = [t.split()[0] if not t.startswith("@") else t.split()[1] for _, t in instrs]

    def count(prefix, texts):
        return sum(1 for t in texts if (t.split()[1] if t.startswith("@") else t.split()[0])
                   .startswith(prefix))

    loops.sort(key=len, reverse=True)
    real = [t for t in ops if t not in ("NOP",)]
    return dict(
        sass_total=len(real),
        loops=[len([t for t in body if not t.endswith("NOP")]) for body in loops],
        loop_detail=[dict(n=len(body), hgmma=count("HGMMA", body),
                          utmaldg=count("UTMALDG", body), ldgsts=count("LDGSTS", body),
                          ldg=count("LDG.", body) + count("LDG ", body),
                          mufu=count("MUFU", body), syncs=count("SYNCS", body),
                          bar=count("BAR", body), lds=count("LDS", body))
                     for body in loops],
        utmaldg=count("UTMALDG", [t for _, t in instrs]),
        utmastg=count("UTMASTG", [t for _, t in instrs]),
        ldgsts=count("LDGSTS", [t for _, t in instrs]),
        hgmma=count("HGMMA", [t for _, t in instrs]),
        stg=count("STG", [t for _, t in instrs]),
    )


def signature(kernel: str, fn, dtype: str, mask_kind: int, d: int, block_m: int, block_n: int):
    from fastattn.kernels import attention
    if kernel == "shipped" or kernel == "tma-dev":
        sig = attention._kernel_signature(attention._attn_fwd, dtype, mask_kind, d)
        if kernel == "tma-dev":  # same leading arguments, no dropout ones
            names = list(inspect.signature(fn.fn).parameters)
            sig = {n: sig.get(n, "constexpr") for n in names}
        return sig
    mask_type = {0: dtype, 1: "u8", 2: dtype}[mask_kind]
    desc = lambda rows: f"tensordesc<{dtype}[1,1,{rows},{d}]>"
    types = {"Q": desc(block_m), "K": desc(block_n), "V": desc(block_n),
             "Out": desc(block_m) if kernel == "tma-host" else f"*{dtype}:16",
             "Mask": f"*{mask_type}:16", "Lse": "*fp32:16", "qk_scale": "fp32"}
    sig = {}
    for name, p in inspect.signature(fn.fn).parameters.items():
        sig[name] = "constexpr" if "constexpr" in str(p.annotation) else types.get(name, "i32")
    return sig


def compile_one(kernel, d, dtype, variant, tile, arch=90):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from experiments.tma_forward import attn_fwd_tma
    from fastattn.kernels import attention

    mask_kind, key_mask, causal = VARIANTS[variant]
    block_m, block_n, warps, stages = tile
    fn = {"shipped": attention._attn_fwd, "tma-host": attn_fwd_tma._attn_fwd_tma,
          "tma-host-ptrO": attn_fwd_tma._attn_fwd_tma,
          "tma-dev": attn_fwd_tma._attn_fwd_tma_dev}[kernel]
    sig = signature(kernel, fn, dtype, mask_kind, d, block_m, block_n)
    constexprs = dict(HEAD_DIM=d, BLOCK_D=d, BLOCK_M=block_m, BLOCK_N=block_n,
                      MASK_KIND=mask_kind, KEY_MASK=key_mask, CAUSAL=causal,
                      DOT_PRECISION="tf32")
    if kernel == "shipped":
        constexprs["DROPOUT"] = False
    else:
        constexprs["O_DESC"] = kernel in ("tma-host", "tma-dev")
    plain, attrs = {}, {}
    for index, (name, kind) in enumerate(sig.items()):
        if kind.startswith("tensordesc"):
            plain[name] = kind
            continue
        plain[name], _, hint = kind.partition(":")
        if hint == "16":
            attrs[(index,)] = [["tt.divisibility", 16]]
    row = dict(kernel=kernel, d=d, dtype=dtype, variant=variant, tile=list(tile), arch=arch)
    try:
        src = ASTSource(fn, plain, constexprs=constexprs, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": warps, "num_stages": stages})
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return row
    regs, spill = _resource_usage(k.asm["cubin"])
    ptx = k.asm["ptx"]
    sass = _sass(k.asm["cubin"])
    dump = os.environ.get("TMA_DUMP")  # a folder: write the PTX and SASS of every row
    if dump:
        os.makedirs(dump, exist_ok=True)
        stem = (f"{kernel}_d{d}_{dtype}_{variant.replace(' ', '-')}_"
                + "_".join(map(str, tile)))
        with open(os.path.join(dump, stem + ".ptx"), "w") as f:
            f.write(ptx)
        with open(os.path.join(dump, stem + ".sass"), "w") as f:
            f.write(sass)
    row.update(regs=regs, spill=spill, smem=k.metadata.shared,
               wgmma=re.search(r"\bwgmma\.", ptx) is not None,
               ptx_tma_load=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global",
                                           ptx)),
               ptx_tma_store=len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx)),
               ptx_tensormap_create=len(re.findall(r"tensormap\.replace", ptx)),
               global_scratch=getattr(k.metadata, "global_scratch_size", 0),
               **sass_stats(sass))
    return row


def fmt(r):
    tile = "x".join(map(str, r["tile"][:2])) + f" w{r['tile'][2]} s{r['tile'][3]}"
    head = f"{r['kernel']:<13} d={r['d']:<3} {r['dtype']:<4} {r['variant']:<11} {tile:<15}"
    if "error" in r:
        return head + "  ERROR " + r["error"]
    tma = f"{r['utmaldg']}/{r['utmastg']}"
    smem_flag = "!" if r["smem"] > SMEM_LIMIT else " "
    loops = ",".join(map(str, r["loops"][:3]))
    return (head + f" regs {r['regs']:>3} spill {r['spill']:>4} smem {r['smem']:>6}{smem_flag}"
            f" wgmma {'y' if r['wgmma'] else 'n'} UTMALDG/STG {tma:>5} LDGSTS {r['ldgsts']:>3}"
            f" HGMMA {r['hgmma']:>3} sass {r['sass_total']:>5} loops {loops}")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="shipped tiles only")
    p.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtype", nargs="+", default=["fp16", "bf16"])
    p.add_argument("--kernel", nargs="+", default=list(KERNELS))
    args = p.parse_args(argv)
    import torch

    from fastattn.kernels import attention
    work = []
    for d, dtype, variant in itertools.product(args.head_dim, args.dtype, VARIANTS):
        mask, key, causal = VARIANTS[variant]
        shipped = attention.launch_tile("_attn_fwd", d, torch.float16, 90,
                                        **attention.tile_variant(mask, key, causal, False))
        tiles = [shipped] if args.quick else list(dict.fromkeys([shipped, *CANDIDATES[d]]))
        for tile in tiles:
            for kernel in args.kernel:
                work.append((kernel, d, dtype, variant, tile))
    if args.jobs <= 1:
        rows = []
        for w in work:
            rows.append(compile_one(*w))
            print(fmt(rows[-1]), flush=True)
    else:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            rows = []
            for r in pool.map(compile_one, *zip(*work, strict=True)):
                rows.append(r)
                print(fmt(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
