"""CPU step time of bf16 mixed-precision training with and without what spares autocast's casts
on GPUs: fastattn.autocast.batched_weight_casts (one cast per layer of its weights), which the
CPU runs too, and the LayerNorm kernels' bf16 copies of their outputs
(fastattn.fused_model.Stream), which it does not (fastattn.fused_model.PER_OP_DEVICES), forced on
here. One bench_train step
(forward, fused loss, backward, fused Adam) of a preset at the paper's batch per GPU, the
variants taking turns in one process (in a rotating order).

    .venv/bin/python -m scripts.measure_cast_savings [--preset multi30k] [--rounds 15]

Prints each variant's median seconds per step and its ratio to fastattn's (> 1: fastattn's is
faster). Each cast is a kernel launch on a GPU (benchmarks/launches.py counts them); this checks
what sparing them costs the CPU path.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import fastattn.fused_model
import fastattn.model
from benchmarks import bench_train

HOMES = {"batched_weight_casts": fastattn.model, "PER_OP_DEVICES": fastattn.fused_model}
SHIPPED = {attribute: getattr(home, attribute) for attribute, home in HOMES.items()}
VARIANTS = {
    "fastattn": {},
    "autocast's weight casts": {"batched_weight_casts": lambda *a: contextlib.nullcontext()},
    "LayerNorm copies": {"PER_OP_DEVICES": ()},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--preset", default="multi30k", choices=sorted(bench_train.CONFIGS))
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    cfg = bench_train.CONFIGS[args.preset]
    torch.manual_seed(0)
    model = fastattn.model.Transformer(cfg).train()
    step = bench_train.training_step(model, bench_train.batch_for(cfg), "mixed")
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(2):  # warm-up
        step()
    names = list(VARIANTS)
    try:
        for round_ in range(args.rounds):
            # Each round starts with the next variant: a step can leave the next one faster or
            # slower (its allocations, the caches), and rotating spreads that over all of them.
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                replaced = VARIANTS[name]
                for attribute, shipped in SHIPPED.items():
                    setattr(HOMES[attribute], attribute, replaced.get(attribute, shipped))
                started = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - started)
    finally:
        for attribute, shipped in SHIPPED.items():
            setattr(HOMES[attribute], attribute, shipped)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{args.preset} {name}: {median:.4f} s per step (median of {args.rounds}), "
              f"{median / medians['fastattn']:.3f}x fastattn's")


if __name__ == "__main__":
    main()
