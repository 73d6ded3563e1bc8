"""Correctness of experiments/tma_forward/attn_fwd_tma.py under the Triton interpreter (CPU),
against torch's scaled_dot_product_attention in float64, on the model's layouts:
  self-attention: q, k, v column slices of one packed projection (B, L, 3*H*D)
  cross-attention: q (B, T, H*D), k, v slices of (B, S, 2*H*D)
at odd lengths (17, 97, ...) so the last tiles are partial and TMA's bounds fill matters, with
key-padding masks (including a batch row whose keys are all padding) and causal.

    .venv/bin/python experiments/tma_forward/check_interp.py [--quick]   # from the repo root
    .venv/bin/python -m experiments.tma_forward.check_interp [--quick]  # the same
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before importing triton

import itertools  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run by path: the repository root, for experiments.* and fastattn
    sys.path.insert(0, ROOT)

from experiments.tma_forward.attn_fwd_tma import attention_forward_tma  # noqa: E402
from fastattn.kernels import attention as shipped  # noqa: E402


def _patch_interpreter_bf16_dot():
    """Triton 3.9's interpreter holds bf16 as its raw bits (uint16) and its tl.dot multiplies
    those integers (repro_interp_bf16.py here: garbage for pointer loads too, which is why the
    project's interpreter tests skip bf16). Widen bf16 operands to float32 first: exact
    (a bf16 is the high half of a float32), and a bf16 x bf16 product is exact in float32 as
    on the tensor cores. The interpreter's float32 -> bf16 rounding (toward zero; a GPU rounds
    to nearest) is left as it is: within the bf16 tolerance below."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16 or h.dtype == tl.bfloat16:
            data = (h.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


if "--no-bf16-patch" not in sys.argv:
    _patch_interpreter_bf16_dot()


def split_heads(x, heads):
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def reference(q, k, v, mask, causal):
    q, k, v = (x.double() for x in (q, k, v))
    lq, lk = q.shape[2], k.shape[2]
    allowed = torch.ones(q.shape[0], 1, lq, lk, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        allowed = allowed & torch.ones(lq, lk, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    empty = ~allowed.any(-1, keepdim=True)  # rows with no key: the kernels return 0
    out = out.masked_fill(empty, 0.0)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1).masked_fill(empty.squeeze(-1), float("inf"))
    return out, lse


def case(kind, b, h, lq, lk, d, dtype, tiles, device_desc, o_desc, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "self-causal" or kind == "self-keypad":
        lk = lq
        qkv = torch.randn(b, lq, 3 * h * d, generator=g).to(dtype)
        q, k, v = (split_heads(t, h) for t in qkv.split(h * d, dim=-1))
    else:  # cross
        q = split_heads(torch.randn(b, lq, h * d, generator=g).to(dtype), h)
        kv = torch.randn(b, lk, 2 * h * d, generator=g).to(dtype)
        k, v = (split_heads(t, h) for t in kv.split(h * d, dim=-1))
    causal = kind == "self-causal"
    mask = None
    if not causal:  # key padding (B, 1, 1, Lk), True = attend; the last row all padding
        lengths = torch.randint(1, lk + 1, (b,), generator=g)
        lengths[0] = lk
        if b > 2:
            lengths[-1] = 0
        mask = (torch.arange(lk)[None, :] < lengths[:, None])[:, None, None, :]
    out, lse = attention_forward_tma(q, k, v, mask, causal, tiles=tiles,
                                     device_desc=device_desc, o_desc=o_desc)
    ref_out, ref_lse = reference(q, k, v, mask, causal)
    err = (out.double() - ref_out).abs().max().item()
    # The shipped kernel on the same inputs (the interpreter's sm_80 tiles), for its error level.
    shipped_out, _ = shipped.attention_forward(q, k, v, mask, None, "top_left" if causal else None,
                                               0.0, d ** -0.5)
    shipped_err = (shipped_out.double() - ref_out).abs().max().item()
    # ... and at this case's tile: the same arithmetic in the same order, so the same bits.
    saved, shipped.launch_tile = shipped.launch_tile, (lambda *a, **kw: tiles)
    try:
        same_tile_out, same_tile_lse = shipped.attention_forward(
            q, k, v, mask, None, "top_left" if causal else None, 0.0, d ** -0.5)
    finally:
        shipped.launch_tile = saved
    bitwise = torch.equal(out, same_tile_out) and torch.equal(lse, same_tile_lse)
    assert torch.isfinite(out).all()
    finite = torch.isfinite(ref_lse)
    lse_ok = torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0
    tol = {torch.float16: 2e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}[dtype]
    ok = err <= tol and lse_ok and lse_err <= 1e-4
    return ok, err, lse_err, shipped_err, bitwise


def main():
    quick = "--quick" in sys.argv
    tiles_by_d = {64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
                  128: [(64, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)]}
    shapes = [("self-causal", 2, 2, 97, 97), ("self-keypad", 3, 2, 97, 97),
              ("cross", 3, 2, 17, 97), ("cross", 3, 2, 97, 17), ("self-causal", 1, 1, 17, 17),
              ("self-keypad", 3, 1, 130, 130)]
    dtypes = [torch.float16, torch.bfloat16]
    failures, n, n_bitwise = 0, 0, 0
    for d in (64, 128):
        for tiles, (kind, b, h, lq, lk), dtype, (device_desc, o_desc) in itertools.product(
                tiles_by_d[d], shapes, dtypes, [(False, True), (False, False), (True, True)]):
            if quick and (tiles != tiles_by_d[d][0] or dtype != torch.float16):
                continue
            n += 1
            ok, err, lse_err, shipped_err, bitwise = case(
                kind, b, h, lq, lk, d, dtype, tiles, device_desc, o_desc, seed=n)
            failures += not ok
            n_bitwise += bitwise
            print(f"{'ok  ' if ok else 'FAIL'} d={d} {str(dtype)[6:]:8} {kind:11} B={b} H={h} "
                  f"Lq={lq:3} Lk={lk:3} tiles={tiles} {'device' if device_desc else 'host'}-desc "
                  f"o_desc={o_desc}  max|out-ref|={err:.2e} (shipped {shipped_err:.2e}) "
                  f"max|lse-ref|={lse_err:.2e} bitwise=shipped@tile: {bitwise}",
                  flush=True)
    print(f"{n - failures}/{n} cases pass; {n_bitwise}/{n} bitwise equal to the shipped kernel "
          f"run at the same tile")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
