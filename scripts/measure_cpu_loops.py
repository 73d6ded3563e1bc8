"""The decoder's and trainer's fused CPU loops on this CPU, per instruction-set level, on one
thread: the output distribution log_softmax(x · Wᵀ) over 8,000 pieces (float32 and int8, the
decoder's last step); the float32 panels at a batch-1 beam's 4 rows by the weight's size (in L2
or not); the decoding attention at the multi30k model's heads (256 rows' self-attention over a
prefix whose positions sit in other cache rows or in their own, and a beam's 4 queries over 15
source positions); and attention forward + backward at the multi30k training shape (causal,
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
    for out in (1024, 5456, 16384):
        w = torch.randn(out, 128) / 128 ** 0.5
        results[f"linear fp32 panels 4x128->{out}"] = best_seconds(
            partial(ops.linear, torch.randn(4, 128), w, ops.pack_linear_weight(w), None))
    keys, values = torch.randn(256, 4, 41, 32), torch.randn(256, 4, 41, 32)
    query = torch.randn(256, 4, 1, 32)
    for length in (4, 13, 30):
        scattered = torch.randint(0, 256, (256, length), generator=torch.Generator().manual_seed(0))
        own = torch.arange(256).unsqueeze(1).expand(256, length).contiguous()
        for name, rows in (("scattered", scattered), ("own", own)):
            results[f"decode_attention (256, 4, 1, 32) over {length}, {name} rows"] = best_seconds(
                partial(ops.decode_attention, query, keys, values, None, 32 ** -0.5, rows))
    results["decode_attention (64, 4, 4, 32) over 15"] = best_seconds(partial(
        ops.decode_attention, torch.randn(64, 4, 4, 32), torch.randn(64, 4, 15, 32),
        torch.randn(64, 4, 15, 32), torch.zeros(64, 15), 32 ** -0.5, None))
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
        print(f"{name:<58}" + "".join(f"{table[level][name]:>10.3f}" for level in args.levels))


if __name__ == "__main__":
    main()
