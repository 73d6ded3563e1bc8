"""Markdown tables from compile_compare.py's JSON (written with --json; by default
experiments/tma_forward/compile_compare.json, next to this file): one row per (head dim,
variant, tile, kernel), fp16 (bf16 compiles to the same numbers: the script checks), with the
blocks per SM that registers and shared memory allow on an H100. compile_compare.md is its
output.

    .venv/bin/python experiments/tma_forward/summarize.py [path/to/compile_compare.json]
"""
import json
import os
import sys

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_compare.json")

REGS_PER_SM, SMEM_PER_SM, SMEM_PER_BLOCK_RESERVED, MAX_WARPS = 65536, 233472, 1024, 64


def blocks_per_sm(regs, smem, warps):
    per_warp = ((regs * 32 + 255) // 256) * 256  # allocated per warp in units of 256
    by_regs = REGS_PER_SM // (per_warp * warps)
    by_smem = SMEM_PER_SM // (smem + SMEM_PER_BLOCK_RESERVED)
    return min(by_regs, by_smem, MAX_WARPS // warps, 32)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_JSON
    with open(path) as f:
        rows = json.load(f)
    key = lambda r: (r["kernel"], r["d"], r["variant"], tuple(r["tile"]))
    fields = ("regs", "spill", "smem", "wgmma", "utmaldg", "utmastg", "ldgsts", "sass_total",
              "loops")
    by = {}
    for r in rows:
        by.setdefault(key(r), {})[r["dtype"]] = r
    same = all(len(v) < 2 or all(v["fp16"].get(f) == v["bf16"].get(f) for f in fields)
               for v in by.values())
    print(f"fp16 and bf16 identical in every field: {same}\n")
    print("| d | variant | tile (M x N, warps, stages) | kernel | regs | spill B | smem B | "
          "blocks/SM | wgmma | UTMALDG/UTMASTG | LDGSTS | SASS total | loop SASS (unchecked, "
          "checked) | per key: loops/BLOCK_N |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["dtype"] != "fp16":
            continue
        m, n, w, s = r["tile"]
        if "error" in r:
            print(f"| {r['d']} | {r['variant']} | {m}x{n} w{w} s{s} | {r['kernel']} | "
                  f"ERROR {r['error']} |")
            continue
        loops = r["loops"][:2]
        print(f"| {r['d']} | {r['variant']} | {m}x{n} w{w} s{s} | {r['kernel']} | {r['regs']} | "
              f"{r['spill']} | {r['smem']} | {blocks_per_sm(r['regs'], r['smem'], w)} | "
              f"{'yes' if r['wgmma'] else 'no'} | {r['utmaldg']}/{r['utmastg']} | {r['ldgsts']} | "
              f"{r['sass_total']} | {', '.join(map(str, loops))} | "
              f"{', '.join(f'{x / n:.1f}' for x in loops)} |")
    dev = [r for r in rows if r["kernel"] == "tma-dev" and "error" not in r]
    if dev:
        replaces = sorted({r["ptx_tensormap_create"] for r in dev})
        scratch = sorted({r["global_scratch"] for r in dev})
        print(f"\ntma-dev: tensormap.replace in PTX {replaces}, global scratch bytes {scratch}")


if __name__ == "__main__":
    main()
