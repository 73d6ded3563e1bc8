"""For a session with a Hopper GPU (not run here: this task had none). Checks the TMA forward
against the shipped one on the GPU, then times both (triton.testing.do_bench, median ms) at the
shipped sm_90 tile and at the tiles the compile comparison singled out, on the model's
layouts (packed projections), fp16 and bf16, d = 64 and 128, key padding and causal.

    .venv/bin/python experiments/tma_forward/gpu_bench.py [--quick]   # from the repo root

Also runs on the CPU with --smoke (correctness only, tiny shapes):

    TRITON_INTERPRET=1 .venv/bin/python experiments/tma_forward/gpu_bench.py --smoke
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run by path: the repository root, for experiments.* and fastattn
    sys.path.insert(0, ROOT)

from experiments.tma_forward.attn_fwd_tma import attention_forward_tma  # noqa: E402
from fastattn.kernels import attention as shipped  # noqa: E402

TILES = {64: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
         128: [(64, 32, 8, 3), (64, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2)]}


def inputs(kind, b, h, length, d, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    qkv = torch.randn(b, length, 3 * h * d, generator=g).to(device=device, dtype=dtype)
    q, k, v = (t.unflatten(-1, (h, -1)).transpose(1, 2) for t in qkv.split(h * d, dim=-1))
    mask = None
    if kind == "key padding":
        lengths = torch.randint(length // 2, length + 1, (b,), generator=g)
        mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :].to(device)
    return q, k, v, mask


def shipped_forward(q, k, v, mask, causal, tile=None):
    if tile is None:
        return shipped.attention_forward(q, k, v, mask, None, "top_left" if causal else None,
                                         0.0, q.shape[-1] ** -0.5)
    saved = shipped.launch_tile  # the shipped kernel at another tile, for like-for-like timing
    shipped.launch_tile = lambda *a, **kw: tile
    try:
        return shipped.attention_forward(q, k, v, mask, None, "top_left" if causal else None,
                                         0.0, q.shape[-1] ** -0.5)
    finally:
        shipped.launch_tile = saved


def main():
    smoke = "--smoke" in sys.argv
    device = "cpu" if smoke else "cuda"
    shapes = [(2, 2, 97)] if smoke else [(32, 16, 128), (16, 16, 512), (4, 16, 2048)]
    if "--quick" in sys.argv:
        shapes = shapes[:2]
    dtypes = [torch.float16] if smoke else [torch.float16, torch.bfloat16]
    for d in (64, 128):
        for kind in ("key padding", "causal"):
            for dtype in dtypes:
                for b, h, length in shapes:
                    if smoke and d == 128:
                        continue
                    q, k, v, mask = inputs(kind, b, h, length, d, dtype, device)
                    causal = kind == "causal"
                    ref, ref_lse = shipped_forward(q, k, v, mask, causal)
                    line = f"d={d} {kind:11} {str(dtype)[6:]:8} B={b:2} H={h} L={length:4}"
                    if not smoke:
                        t_ref = _bench(lambda q=q, k=k, v=v, mask=mask, causal=causal:
                                       shipped_forward(q, k, v, mask, causal))
                        line += f" shipped {t_ref:.4f} ms |"
                    for tile in TILES[d][:1] if smoke else TILES[d]:
                        out, lse = attention_forward_tma(q, k, v, mask, causal, tiles=tile)
                        err = (out.float() - ref.float()).abs().max().item()
                        ok = err < (2e-3 if dtype == torch.float16 else 2e-2) and torch.allclose(
                            lse, ref_lse, atol=1e-4)
                        line += f" {tile[0]}x{tile[1]}w{tile[2]}s{tile[3]}"
                        line += f" {'ok' if ok else 'WRONG'} err {err:.1e}"
                        if not smoke:
                            t = _bench(lambda q=q, k=k, v=v, mask=mask, causal=causal, tile=tile:
                                       attention_forward_tma(q, k, v, mask, causal, tiles=tile))
                            t_s = _bench(lambda q=q, k=k, v=v, mask=mask, causal=causal,
                                         tile=tile: shipped_forward(q, k, v, mask, causal, tile))
                            line += f" tma {t:.4f} ms shipped-same-tile {t_s:.4f} ms |"
                    print(line, flush=True)


def _bench(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100)


if __name__ == "__main__":
    if "--smoke" in sys.argv:
        assert os.environ.get("TRITON_INTERPRET") == "1", "--smoke needs TRITON_INTERPRET=1"
    main()
