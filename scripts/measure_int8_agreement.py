"""How often the shipped model's int8 translations equal its float32 ones, per instruction-set
level (int8 quantizes activations to 7 bits on AVX2, 8 with VNNI): the first member of
multi30k-en-de, the first 256 test2016 sources, beam 4, the best hypothesis's tokens.

    python -m scripts.measure_int8_agreement [--levels avx512 avx2]
"""

from __future__ import annotations

import argparse

from benchmarks.common import HELD_ISA, run_held


def agreement() -> str:
    import torch

    from fastattn import data
    from fastattn.inference import pretrained
    from fastattn.inference.decoder import Decoder

    model, sp, _ = pretrained.load("multi30k-en-de")
    member = model.members[0].eval()
    sources = data.load_multi30k("test2016", "en", "de").src[:256]
    ids = [sp.encode(s) + [sp.eos_id()] for s in sources]
    best = {}
    for precision in ("fp32", "int8"):
        decoder, best[precision] = Decoder(member, precision), []
        for i in range(0, len(ids), 64):
            batch = ids[i:i + 64]
            src = torch.full((len(batch), max(map(len, batch))), sp.pad_id(), dtype=torch.long)
            for j, row in enumerate(batch):
                src[j, :len(row)] = torch.tensor(row)
            best[precision] += [h[0].tokens for h in decoder.beam_search(
                src, beam_size=4, bos_id=sp.bos_id(), eos_id=sp.eos_id(), max_len=60)]
    same = sum(a == b for a, b in zip(best["fp32"], best["int8"], strict=True))
    return f"{torch.ops.fastattn.int8_kernel():<12} {same}/{len(ids)} ({same / len(ids):.1%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--levels", nargs="+", default=["avx512", "avx2"], choices=list(HELD_ISA))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(agreement())
        return
    print("int8 kernel  int8 outputs equal to float32's")
    for level in args.levels:
        print(run_held("scripts.measure_int8_agreement", level, "--child"))


if __name__ == "__main__":
    main()
