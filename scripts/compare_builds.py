"""Two builds of fastattn._C against each other, on one thread: beam-search decoding (beam 4;
sentences per second of benchmarks/bench_decoding.py's model and sources) or the training's
attention (--attention: the CPU kernels' causal forward and backward with dropout at the base
preset's shape, 125 sentences x 8 heads x 25 positions x 64; passes per second). Each
measurement runs in a fresh process that loads the given build, the builds alternating pair by
pair (A B, B A, ...) so that the machine's drift falls on both; prints each pair's B/A and the
medians.

    python -m scripts.compare_builds OLD.so NEW.so [--model multi30k] [--precision fp32]
        [--batch 16] [--rounds 6] [--pairs 6] [--attention]

Keep a build by copying fastattn/_C*.so aside after `python setup.py build_ext --inplace`. A
build may also be a checkout's directory with its extension built in place (`git worktree add
DIR COMMIT`, then `python setup.py build_ext --inplace` there): its runs take that checkout's
Python side too, for builds whose ops this one's Python does not call. Hold both to a level
with the usual variables (FASTATTN_CPU_ISA=avx2, ATEN_CPU_CAPABILITY=avx2, ...).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def load_build(build: str) -> None:
    """fastattn._C from `build`, in this (the child) process, before fastattn imports its own."""
    import torch  # noqa: F401 - fastattn._C links against the libraries it loads

    loader = importlib.machinery.ExtensionFileLoader("fastattn._C", build)
    spec = importlib.util.spec_from_file_location("fastattn._C", build, loader=loader)

    module = importlib.util.module_from_spec(spec)
    sys.modules["fastattn._C"] = module  # before fastattn imports its own
    spec.loader.exec_module(module)


def best_rate(work, units: float, rounds: int) -> float:
    """units / the best of `rounds` timed calls of work(), after one untimed."""
    work()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return units / best


def decoding(model_name: str, precision: str, batch: int, rounds: int) -> float:
    """Sentences per second of two batches decoded, the best of `rounds`."""
    from benchmarks.bench_decoding import fastattn_decoder, load

    model = load(model_name)
    sources = model.sources(2 * batch)
    batches = [sources[i : i + batch] for i in range(0, len(sources), batch)]
    decode = fastattn_decoder(model, precision)
    return best_rate(lambda: [decode(b) for b in batches], len(sources), rounds)


def attention(rounds: int) -> float:
    """Forward + backward passes per second (20 a round) of the CPU attention kernels."""
    import torch

    ops = torch.ops.fastattn
    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(125, 8, 25, 64) for _ in range(4))

    def passes():
        for _ in range(20):
            out, lse = ops.cpu_attention_fwd(q, k, v, None, True, 0, 0.125, 0.1, 7)
            ops.cpu_attention_bwd(grad, q, k, v, out, lse, None, True, 0, 0.125, 0.1, 7)

    return best_rate(passes, 20, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("a", help="build A: a fastattn._C shared object, or a checkout's "
                        "directory with its extension built in place")
    parser.add_argument("b", help="build B")
    parser.add_argument("--model", default="multi30k", choices=["multi30k", "d512-6+6"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "int8", "bf16"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--attention", action="store_true",
                        help="time the training's attention kernels instead of decoding")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        if not Path(args.a).is_dir():  # a checkout: its own fastattn comes first on the path
            load_build(args.a)
        torch.set_num_threads(1)
        print(attention(args.rounds) if args.attention
              else decoding(args.model, args.precision, args.batch, args.rounds))
        return

    def run(build: str) -> float:
        command = [sys.executable, str(Path(__file__).resolve()), build, build, "--child",
                   "--model", args.model, "--precision", args.precision,
                   "--batch", str(args.batch), "--rounds", str(args.rounds),
                   *(["--attention"] if args.attention else [])]
        # The child imports fastattn and benchmarks from the checkout given, else from here.
        tree = Path(build).resolve() if Path(build).is_dir() else Path.cwd()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
        done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=tree,
                              env=env)
        return float(done.stdout.split()[-1])

    what = ("attention forward + backward" if args.attention
            else f"{args.model} {args.precision} batch {args.batch}")
    unit = "passes/s" if args.attention else "sentences/s"
    a_rates, b_rates, ratios = [], [], []
    for pair in range(args.pairs):
        if pair % 2:
            b, a = run(args.b), run(args.a)
        else:
            a, b = run(args.a), run(args.b)
        a_rates.append(a), b_rates.append(b), ratios.append(b / a)
        print(f"pair {pair + 1}: A {a:.1f}, B {b:.1f} {unit}, B/A {b / a:.3f}", flush=True)
    print(f"{what}: A {statistics.median(a_rates):.1f}, "
          f"B {statistics.median(b_rates):.1f} {unit} (medians); B/A median "
          f"{statistics.median(ratios):.3f}, {min(ratios):.3f} to {max(ratios):.3f}")


if __name__ == "__main__":
    main()
