"""CPU step time of bf16 mixed-precision training with fastattn.autocast.batched_weight_casts
against autocast's own per-weight casts: one bench_train step (forward, fused loss, backward,
fused Adam) of a preset at the paper's batch per GPU, the two taking turns in one process.

    .venv/bin/python -m scripts.measure_weight_casts [--preset multi30k] [--rounds 15]

Prints each one's median seconds per step and the ratio (autocast's / batched: > 1, batched is
faster). The casts matter on GPUs, where each is a kernel launch (benchmarks/launches.py); this
checks that batching them costs the CPU path nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import fastattn.model
from benchmarks import bench_train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="multi30k", choices=sorted(bench_train.CONFIGS))
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    cfg = bench_train.CONFIGS[args.preset]
    sentences, src_len, tgt_len = bench_train.BATCH
    generator = torch.Generator().manual_seed(0)
    src, tgt = (torch.randint(1, vocab, (sentences, n), generator=generator)
                for vocab, n in ((cfg.vocab_size, src_len), (cfg.output_size, tgt_len + 1)))
    torch.manual_seed(0)
    model = fastattn.model.Transformer(cfg).train()
    step = bench_train.training_step(model, (src, tgt[:, :-1], tgt[:, 1:]), "mixed")
    casts = {"batched": fastattn.model.batched_weight_casts,
             "autocast": lambda *args: contextlib.nullcontext()}
    times: dict[str, list[float]] = {name: [] for name in casts}
    for _ in range(2):  # warm-up
        step()
    for _ in range(args.rounds):
        for name, context in casts.items():
            fastattn.model.batched_weight_casts = context
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    fastattn.model.batched_weight_casts = casts["batched"]
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{args.preset} {name}: {median:.4f} s per step (median of {args.rounds})")
    print(f"autocast / batched: {medians['autocast'] / medians['batched']:.3f}")


if __name__ == "__main__":
    main()
