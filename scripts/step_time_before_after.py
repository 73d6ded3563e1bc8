"""CPU step time of this checkout against another (an older commit's worktree): one
bench_train step (forward, fused loss, backward, fused Adam) of a preset at the paper's batch per
GPU, or with --update the trainer's whole update (fastattn.train.train_step: the step with the
gradient norm, the NaN guard and the read of its results), each checkout in processes of its own,
taking turns.

    git worktree add /tmp/before <commit>   # and copy fastattn/_C*.so into it if csrc is the same
    .venv/bin/python -m scripts.step_time_before_after /tmp/before [--preset multi30k]
        [--precision mixed] [--update] [--runs 3] [--rounds 25]

Prints each run's median seconds per step, then the median over runs of each checkout and the
ratio (before / after: > 1, this checkout is faster).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
# Run inside the child: the checkout's own fastattn and benchmarks, its median step time. It
# builds bench_train's batch itself (not bench_train.batch_for), as older checkouts lack that.
CHILD = """
import statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import fastattn.model
from benchmarks import bench_train
assert fastattn.model.__file__.startswith(sys.argv[1]), fastattn.model.__file__
preset, precision, rounds, update = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
cfg = bench_train.CONFIGS[preset]
sentences, src_len, tgt_len = bench_train.BATCH
generator = torch.Generator().manual_seed(0)
src, tgt = (torch.randint(1, vocab, (sentences, n), generator=generator)
            for vocab, n in ((cfg.vocab_size, src_len), (cfg.output_size, tgt_len + 1)))
torch.manual_seed(0)
model = fastattn.model.Transformer(cfg).train()
step = bench_train.training_step(model, (src, tgt[:, :-1], tgt[:, 1:]), precision)
if update == "update":
    from fastattn.train import LossModule, train_step
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                                 fused=True)
    dtype = bench_train.low_precision() if precision == "mixed" else None
    batch = [(src, tgt[:, :-1], tgt[:, 1:])]
    step = lambda: train_step(LossModule(model), optimizer, batch, autocast_dtype=dtype)
for _ in range(3):
    step()
times = []
for _ in range(rounds):
    started = time.perf_counter()
    step()
    times.append(time.perf_counter() - started)
print(statistics.median(times))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("before", type=Path, help="the other checkout (a git worktree)")
    parser.add_argument("--preset", default="multi30k")
    parser.add_argument("--precision", default="mixed", choices=["fp32", "mixed"])
    parser.add_argument("--update", action="store_true",
                        help="time fastattn.train.train_step instead of bench_train's step")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    checkouts = {"before": args.before.resolve(), "after": HERE}
    medians: dict[str, list[float]] = {name: [] for name in checkouts}
    for _ in range(args.runs):
        for name, path in checkouts.items():
            out = subprocess.run([sys.executable, "-c", CHILD, str(path), args.preset,
                                  args.precision, str(args.rounds),
                                  "update" if args.update else "step"], cwd="/", check=True,
                                 capture_output=True, text=True).stdout
            medians[name].append(float(out.split()[-1]))
            print(f"{name} ({path}): {medians[name][-1]:.4f} s per step")
    before, after = (statistics.median(medians[name]) for name in checkouts)
    print(f"{args.preset} {args.precision}: before {before:.4f} s, after {after:.4f} s, "
          f"before / after {before / after:.3f}")


if __name__ == "__main__":
    main()
