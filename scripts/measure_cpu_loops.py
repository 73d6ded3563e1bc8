"""The decoder's and trainer's fused CPU loops on this CPU, per instruction-set level, on one
thread: the output distribution log_softmax(x · Wᵀ) over 8,000 pieces (float32 and int8, the
decoder's last step) and attention forward + backward at the multi30k training shape (causal,
dropout 0.1). Milliseconds per call, the best of a few; each level in a process of its own with
every library held to it (benchmarks.common.HELD_ISA).

    python -m scripts.measure_cpu_loops [--levels avx512 avx2]
"""

from __future__ import annotations

import argparse
import json
from functools import partial

from benchmarks.common import HELD_ISA, run_held
from scripts.measure_cpu_products import best_seconds


def measure() -> dict[str, float]:
    import torch

    import fastattn._native  # noqa: F401 - loads fastattn._C
    from fastattn import ops as fused

    ops = torch.ops.fastattn
    torch.set_num_threads(1)
    results = {}
    for depth in (128, 512):
        w = torch.randn(8000, depth) / depth ** 0.5
        packed, int8 = ops.pack_linear_weight(w), ops.quantize_linear_weight(w)
        for rows in (4, 64, 256):
            x = torch.randn(rows, depth)
            results[f"log_softmax_linear fp32 {rows}x{depth}->8000"] = best_seconds(
                partial(ops.log_softmax_linear, x, w, packed))
            results[f"log_softmax_linear int8 {rows}x{depth}->8000"] = best_seconds(
                partial(ops.log_softmax_linear_int8, x, *int8))
    q, k, v = (torch.randn(125, 4, 25, 32, requires_grad=True) for _ in range(3))
    grad = torch.randn(125, 4, 25, 32)

    def attention_step():
        fused.attention(q, k, v, causal=True, dropout_p=0.1).backward(grad)

    results["attention fwd+bwd (125, 4, 25, 32) causal, dropout 0.1"] = best_seconds(attention_step)
    return {name: seconds * 1e3 for name, seconds in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--levels", nargs="+", default=["avx512", "avx2"], choices=list(HELD_ISA))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    table = {}
    for level in args.levels:
        table[level] = json.loads(run_held("scripts.measure_cpu_loops", level, "--child",
                                           one_thread=True))
    print(f"{'ms per call, one thread':<58}" + "".join(f"{level:>10}" for level in args.levels))
    for name in table[args.levels[0]]:
        print(f"{name:<58}" + "".join(f"{table[level][name]:>10.2f}" for level in args.levels))


if __name__ == "__main__":
    main()
