"""The measurements behind fastattn.inference.workers.choose: sentences per second of beam search
(beam 4, fixed work per sentence) with 1 worker x all cores against one-thread workers, one per
core.

    .venv/bin/python scripts/measure_workers.py [--sentences 128] [--repeats 2]
        [--precision fp32] [--models multi30k,large] [--batches 64,16,1]

Models, random (the throughput of a trained one is the same at the same output lengths): the
`multi30k` preset and a larger one (d_model 512, 6+6 layers, 8 heads, d_ff 2048), 8,000 pieces
each, with a SentencePiece model of Multi30k's training text, as benchmarks/bench_decoding.py
builds them. Sources: the first --sentences of test2016 (English), consecutive batches of
--batches sentences; every sentence decodes to MAX_LEN tokens (an untrained model rarely ends
one earlier), so each configuration does the same work. The configurations take turns, --repeats
rounds, and each cell is the best of its runs, with (in brackets) the cores that other processes
kept busy meanwhile (from /proc/stat, less this process's CPU time): on a shared machine a cell
with others near 0 is the one to trust. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time

import torch

from fastattn import data
from fastattn.inference import Decoder
from fastattn.inference.workers import Workers
from fastattn.model import Transformer

BEAM, ALPHA, MAX_LEN = 4, 0.6, 40
MODELS = {
    "multi30k": dict(name="multi30k"),
    "large": dict(name="base", d_model=512, encoder_layers=6, decoder_layers=6, heads=8,
                  d_ff=2048),
}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return fields.get("Model name", "").strip()


def others_busy() -> float:
    """CPU seconds spent so far by every process but this one (Linux's /proc/stat)."""
    with open("/proc/stat") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:]]
    busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle
    times = os.times()
    return busy - times.user - times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--sentences", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--models", default="multi30k,large")
    parser.add_argument("--batches", default="64,16,1")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    text = data.load_multi30k("train", "en", "de")
    sp = data.load_sentencepiece(data.train_sentencepiece(list(text.src) + list(text.tgt), 8000))
    sentences = data.load_multi30k("test2016", "en", "de").src[: args.sentences]
    sources = [sp.encode(s) + [sp.eos_id()] for s in sentences]
    configurations = [(1, cores), (cores, 1)]
    print(f"CPU: {cpu_model()}, {cores} cores; torch {torch.__version__}; precision "
          f"{args.precision}; {len(sources)} test2016 sentences, beam {BEAM}, {MAX_LEN} tokens "
          f"each; best of {args.repeats}; load average before: {os.getloadavg()[0]:.2f}\n")
    print("| model | batch | " + " | ".join(f"{w} worker(s) x {t} thread(s)"
                                             for w, t in configurations) + " |")
    print("|---|---|" + "---|" * len(configurations))
    for model_name in args.models.split(","):
        options = dict(MODELS[model_name])
        torch.manual_seed(0)
        model = Transformer.from_preset(options.pop("name"), vocab_size=8000, dropout=0.0,
                                        **options).eval()
        decoder = Decoder(model, args.precision)

        def decode(batch: list[list[int]], decoder=decoder) -> None:
            source = torch.full((len(batch), max(map(len, batch))), sp.pad_id(),
                                dtype=torch.long)
            for i, ids in enumerate(batch):
                source[i, : len(ids)] = torch.tensor(ids)
            decoder.beam_search(source, beam_size=BEAM, bos_id=sp.bos_id(), eos_id=sp.eos_id(),
                                max_len=MAX_LEN + 1, alpha=ALPHA, length_penalty="pow")

        for batch_size in map(int, args.batches.split(",")):
            # Batch 1 costs the most per sentence: fewer of them keep its cells short.
            count = len(sources) if batch_size > 1 else max(len(sources) // 8, 2 * cores)
            batches = [sources[i: i + batch_size] for i in range(0, count, batch_size)]
            pools = [Workers(workers, threads) for workers, threads in configurations]
            best = [(float("inf"), 0.0)] * len(pools)  # (seconds, cores others kept busy)
            for pool in pools:
                list(pool.map(decode, batches[: pool.workers]))  # warm: packed weights, buffers
            for _ in range(args.repeats):
                for k, pool in enumerate(pools):
                    start, others = time.perf_counter(), others_busy()
                    for _ in pool.map(decode, batches):
                        pass
                    seconds = time.perf_counter() - start
                    best[k] = min(best[k], (seconds, (others_busy() - others) / seconds))
            for pool in pools:
                pool.close()
            print(f"| {model_name} | {batch_size} | "
                  + " | ".join(f"{count / seconds:.2f} ({others:.1f})" for seconds, others in best)
                  + " |", flush=True)
    print(f"\nsentences per second (cores other processes kept busy); load average after: "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
