"""The decoder's and trainer's linear maps on this CPU, per instruction-set level: fastattn._C's
packed float32, int8 and bf16 products against what torch's wheel ships (MKL's sgemm through
F.linear, fbgemm's dynamic int8 linear on prepacked weights, oneDNN's int8 product
torch._int_mm on rows already quantized (int32 sums only: no quantizing, no scaling back) and
its bf16 F.linear on bf16 tensors (bf16 out); both AMX's tiles where the level allows), and at
the output layers' shapes the decoding step's fused log_softmax(x · Wᵀ) against F.linear +
log_softmax; GFLOP/s on one thread.

    python -m scripts.measure_cpu_products [--levels avx512 avx2] [--rows 1 4 16 64 256]

Each level runs in a process of its own with everything held to it (FASTATTN_CPU_ISA,
ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA), as an AVX2 CPU would run it.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

from benchmarks.common import HELD_ISA, run_held

# (in, out): d512 attention projections, feed-forward in and out, the output layer (vocab 8000);
# the multi30k preset's d256 / 1024; the shipped multi30k model's (d128, feed-forward 256): its
# decoder's qkv, other attention maps, W1 and W2, and its output layer (5455 words).
SHAPES = [(512, 512), (512, 2048), (2048, 512), (512, 8000), (256, 256), (256, 1024),
          (128, 384), (128, 128), (128, 256), (256, 128), (128, 5455)]
OUTPUT_LAYERS = {(512, 8000), (128, 5455)}
KERNELS = ["fastattn fp32", "F.linear fp32", "fastattn int8", "fbgemm int8", "oneDNN int8",
           "fastattn bf16", "oneDNN bf16", "fastattn log_softmax", "torch log_softmax"]


def best_seconds(fn, budget: float = 0.3) -> float:
    fn()
    best, spent = float("inf"), 0.0
    while spent < budget:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return best


def measure(rows_list: list[int]) -> list[dict]:
    import torch
    import torch.nn.functional as F

    import fastattn._native  # noqa: F401 - loads fastattn._C
    ops = torch.ops.fastattn
    torch.set_num_threads(1)
    results = []
    for d_in, d_out in SHAPES:
        w = torch.randn(d_out, d_in) / d_in ** 0.5
        b = torch.randn(d_out)
        packed = ops.pack_linear_weight(w)
        int8 = ops.quantize_linear_weight(w)
        bf16 = ops.pack_linear_weight_bf16(w)
        per_channel = torch.quantize_per_channel(w, w.abs().amax(1) / 127,
                                                 torch.zeros(d_out, dtype=torch.long), 0,
                                                 torch.qint8)
        fbgemm = torch.ops.quantized.linear_prepack(per_channel, b)
        w_int8, w_bf16, b_bf16 = per_channel.int_repr().T, w.bfloat16(), b.bfloat16()
        for rows in rows_list:
            x = torch.randn(rows, d_in)
            x_int8 = torch.randint(-127, 128, (rows, d_in), dtype=torch.int8)
            flops = 2 * rows * d_in * d_out
            cases = {
                "fastattn fp32": partial(ops.linear, x, w, packed, b),
                "F.linear fp32": partial(F.linear, x, w, b),
                "fastattn int8": partial(ops.linear_int8, x, *int8, b),
                "fbgemm int8": partial(torch.ops.quantized.linear_dynamic, x, fbgemm, True),
                "oneDNN int8": partial(torch._int_mm, x_int8, w_int8),
                "fastattn bf16": partial(ops.linear_bf16, x, bf16, b, d_out),
                "oneDNN bf16": partial(F.linear, x.bfloat16(), w_bf16, b_bf16),
            }
            if (d_in, d_out) in OUTPUT_LAYERS:
                cases["fastattn log_softmax"] = partial(ops.log_softmax_linear, x, w, packed)
                cases["torch log_softmax"] = lambda x=x, w=w: F.log_softmax(F.linear(x, w), -1)
            for name, fn in cases.items():
                seconds = best_seconds(fn)
                results.append({"shape": f"{d_in}x{d_out}", "rows": rows, "kernel": name,
                                "gflops": flops / seconds / 1e9})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--levels", nargs="+", default=["avx512", "avx2"], choices=list(HELD_ISA),
                        help="amx too where the CPU has it")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.rows)))
        return
    table: dict[tuple, dict] = {}
    for level in args.levels:
        out = run_held("scripts.measure_cpu_products", level, "--child", "--rows",
                       *map(str, args.rows), one_thread=True)
        for r in json.loads(out):
            table.setdefault((level, r["shape"], r["rows"]), {})[r["kernel"]] = r["gflops"]
    print(f"{'level':<7}{'shape':<10}{'rows':>5}  " + "".join(f"{k:>21}" for k in KERNELS))
    for (level, shape, rows), row in table.items():
        print(f"{level:<7}{shape:<10}{rows:>5}  "
              + "".join(f"{row[k]:>21.1f}" if k in row else f"{'–':>21}" for k in KERNELS))


if __name__ == "__main__":
    main()
