"""The cases gpu_check added for a first GPU run (issue 69 item 4), as far as a CPU checks them:
on both backends, and under FASTATTN_BACKEND=triton TRITON_INTERPRET=1 on the Triton kernels
themselves. The packed backward into (B, L, 3·H·D) at lengths 1, 17 and 97 against fp64 with
masks, fully padded sentences and grad_output != 1; dropout's keep rate and one mask forward
and backward (attention, packed attention, rows allowed no key, LayerNorm and the embedding in
the training mix of dtypes); keys, values, the output and its gradient with rows past 2**31
elements. Each test takes a few seconds interpreted."""

import pytest
import torch
from conftest import assert_graded_close

from fastattn import ops
from fastattn.backend import implementation
from fastattn.ops.attention import _dropout_keep_mask, attention_packed, attention_reference
from fastattn.ops.embedding import embedding, embedding_reference
from fastattn.ops.layer_norm import layer_norm_residual_reference

# Every test here reaches an op; under FASTATTN_BACKEND=triton the kernels run interpreted.
pytestmark = pytest.mark.triton

HEADS, D, B = 2, 16, 3


def _packed(form, lq, lk, dtype):
    """attention_packed's inputs: x (B, L, 3·H·D), or x (B, Lq, H·D) and kv (B, Lk, 2·H·D)."""
    if form == "self":
        return [torch.randn(B, lq, 3 * HEADS * D, dtype=dtype)]
    return [torch.randn(B, lq, HEADS * D, dtype=dtype), torch.randn(B, lk, 2 * HEADS * D,
                                                                   dtype=dtype)]


def _views(xs):
    """q, k, v (B, H, L, D) as the model unpacks them."""
    x, kv = xs[0], xs[1] if len(xs) > 1 else None
    width = x.shape[-1] // 3 if kv is None else x.shape[-1]
    parts = x.split(width, -1) if kv is None else (x, *kv.split(width, -1))
    return [t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in parts]


def _run(fn, inputs, grad_out):
    """fn(*inputs) and the gradients of <out, grad_out> with respect to inputs."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]


def _key_padding(lengths, lk):
    return (torch.arange(lk) < torch.tensor(lengths)[:, None])[:, None, None, :]


def _packed_op(backward_names, **kwargs):
    def run(*xs):
        out = attention_packed(xs[0], xs[1] if len(xs) > 1 else None, heads=HEADS, **kwargs)
        backward_names.append(type(out.grad_fn).__name__)
        return out
    return run


def _grade(ours, exact, own, names):
    for name, a, r, b in zip(names[:len(ours)], ours, exact, own, strict=True):
        atol = 2e-5 if a.dtype == torch.float32 else 1e-3
        assert_graded_close(a, r, b, atol=atol, name=name)


@pytest.mark.parametrize("form,lq,lk,dtype,mask,causal", [
    ("self", 1, 1, torch.float32, "key padding", False),  # a size-1 length's arbitrary stride
    ("self", 97, 97, torch.float16, "a sentence all padding", False),
    ("self", 17, 17, torch.float16, None, True),
    ("cross", 1, 97, torch.float32, "key padding", False),
    ("cross", 97, 17, torch.float16, None, "bottom_right"),
], ids=["self-1", "self-97-fp16-padded", "self-17-fp16-causal", "cross-1x97",
        "cross-97x17-fp16-bottom-right"])
def test_packed_backward_against_float64(seeded, form, lq, lk, dtype, mask, causal):
    """attention_packed's values and the gradients its backward writes into the packed
    inputs' columns, against fp64 on the views, graded by PyTorch's own error in the dtype;
    rows allowed no key (a sentence all padding; bottom-right queries before the keys) read
    zero and pass zero gradient to their queries."""
    inputs = _packed(form, lq, lk, dtype)
    attn_mask = None
    if mask is not None:
        attn_mask = _key_padding([0 if mask == "a sentence all padding" else lk, max(lk - 4, 1),
                                  1], lk)
    kwargs = dict(causal=causal, attn_mask=attn_mask)
    grad_out = torch.randn(B, HEADS, lq, D, dtype=dtype) * 3
    names = []
    ours = _run(_packed_op(names, **kwargs), inputs, grad_out)
    if implementation("attention", "cpu", dtype, True, head_dim=D) != "torch":
        assert names == ["_PackedAttentionBackward"]
    exact = _run(lambda *xs: attention_reference(*_views(xs), **kwargs),
                 [x.double() for x in inputs], grad_out.double())
    own = _run(lambda *xs: attention_reference(*_views(xs), **kwargs), inputs, grad_out)
    _grade(ours, exact, own, ["out", "dx", "dkv"])
    empty = torch.zeros(B, HEADS, lq, dtype=torch.bool)
    if mask == "a sentence all padding":
        empty[0] = True
    if causal == "bottom_right":
        empty[:, :, :lq - lk] = True
    dq = _views([ours[1], *ours[2:]])[0]
    assert torch.equal(ours[0][empty], torch.zeros_like(ours[0][empty]))
    assert torch.equal(dq[empty], torch.zeros_like(dq[empty]))
    assert all(t.isfinite().all() for t in ours)


def _keep_rate_ok(keep, p):
    sigma = (p * (1 - p) / keep.numel()) ** 0.5
    return abs(keep.float().mean().item() - (1 - p)) <= 5 * sigma


@pytest.mark.parametrize("form,lq,lk,dtype", [("self", 17, 17, torch.float32),
                                              ("cross", 17, 97, torch.float16)])
def test_packed_dropout_against_float64_given_its_mask(form, lq, lk, dtype):
    """With dropout the packed op draws the mask attention() draws (_dropout_keep_mask, at the
    same RNG state), in the forward and the backward: given it, fp64 explains the output and
    the packed gradients; its keep rate is 1 - p."""
    p = 0.25
    inputs = _packed(form, lq, lk, dtype)
    attn_mask = _key_padding([lk, lk // 2, 1], lk)
    grad_out = torch.randn(B, HEADS, lq, D, dtype=dtype) * 3
    q, k, _ = _views(inputs)
    torch.manual_seed(21)
    keep = _dropout_keep_mask(q, k, p)
    assert _keep_rate_ok(keep, p)
    torch.manual_seed(21)
    ours = _run(_packed_op([], attn_mask=attn_mask, dropout_p=p), inputs, grad_out)

    def reference(*xs):
        return attention_reference(*_views(xs), attn_mask=attn_mask, dropout_p=p,
                                   dropout_keep=keep)

    exact = _run(reference, [x.double() for x in inputs], grad_out.double())
    own = _run(reference, inputs, grad_out)
    _grade(ours, exact, own, ["out", "dx", "dkv"])


def test_rows_allowed_no_key_stay_zero_under_dropout(seeded):
    """Empty rows with dropout: zeros out and zero dq there, finite everywhere, and the rest
    against fp64 given the op's mask."""
    p = 0.3
    q, k, v = (torch.randn(2, 2, n, D) for n in (9, 12, 12))
    allowed = torch.rand(2, 2, 9, 12) > 0.4
    allowed[..., 0] = True
    allowed[0, 1, 4] = allowed[1, :, 7] = False
    grad_out = torch.randn(2, 2, 9, D) * 3
    torch.manual_seed(5)
    keep = _dropout_keep_mask(q, k, p)
    torch.manual_seed(5)
    ours = _run(lambda q, k, v: ops.attention(q, k, v, attn_mask=allowed, dropout_p=p),
                [q, k, v], grad_out)

    def reference(q, k, v):
        return attention_reference(q, k, v, attn_mask=allowed, dropout_p=p, dropout_keep=keep)

    exact = _run(reference, [q.double(), k.double(), v.double()], grad_out.double())
    _grade(ours, exact, _run(reference, [q, k, v], grad_out), ["out", "dq", "dk", "dv"])
    empty = ~allowed.any(-1)
    for t in ours[:2]:
        assert torch.equal(t[empty], torch.zeros_like(t[empty]))
    assert all(t.isfinite().all() for t in ours)


def _outputs_and_grads(fn, inputs, grads, **constants):
    leaves = [x.detach().requires_grad_() for x in inputs]
    outs = fn(*leaves, **constants)
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grads, strict=True)])
    return [o.detach() for o in outs] + [x.grad for x in leaves]


def test_layer_norm_training_mix_against_float64():
    """The post-norm sub-layer connection as autocast trains it: fp16 x beside the fp32
    residual stream, fp32 parameters, x's bias, dropout and y's fp16 copy, on 17 rows of 1000
    features (a ragged block). The mask the op draws (its own dropout of ones, same RNG state)
    explains y, the copy and every gradient against fp64; the copy is y rounded; each gradient
    is in its input's dtype; the keep rate is 1 - p."""
    p, n, features = 0.1, 17, 1000
    g = torch.Generator().manual_seed(3)
    masters = [torch.randn(*s, generator=g, dtype=torch.float64)
               for s in ((n, features), (n, features), (features,), (features,), (features,))]
    dy, dc = (torch.randn(n, features, generator=g, dtype=torch.float64).half().double()
              for _ in range(2))
    inputs = [masters[0].half(), *(t.float() for t in masters[1:])]
    torch.manual_seed(8)
    _, s = ops.layer_norm_residual(torch.ones_like(inputs[0]), torch.zeros_like(inputs[1]),
                                   None, None, dropout_p=p, return_residual=True)
    keep = s != 0
    assert _keep_rate_ok(keep, p)
    torch.manual_seed(8)
    ours = _outputs_and_grads(lambda x, r, w, b, xb: ops.layer_norm_residual(
        x, r, w, b, dropout_p=p, copy_dtype=torch.float16, x_bias=xb), inputs, [dy, dc])

    def reference(x, r, w, b, xb):
        y = layer_norm_residual_reference(x.to(r.dtype) + xb, r, w, b, 1e-5, keep, p)[0]
        return y, y if y.dtype == torch.float64 else y.half()

    exact = _outputs_and_grads(reference, masters, [dy, dc])
    own = _outputs_and_grads(reference, inputs, [dy, dc])
    assert torch.equal(ours[1], ours[0].half())
    assert [t.dtype for t in ours[2:]] == [t.dtype for t in inputs]
    _grade(ours, exact, own, ["y", "copy", "dx", "dresidual", "dweight", "dbias", "dx_bias"])


def test_embedding_training_mix_against_float64():
    """The model's embedding under autocast: fp32 weight and positions, dropout and an fp16
    copy, 33 positions. The op's own mask (one token of ones, zero positions, same RNG state)
    explains y, the copy and the weight gradient (the copy's added to y's) against fp64; the
    copy is y rounded; the keep rate is 1 - p."""
    p, length, vocab, d = 0.2, 33, 97, 24
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, vocab, (3, length), generator=g)
    tokens[0, :20] = 7  # one token many times: its gradient rows add up
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64) * d**-0.5
    positions = torch.randn(length, d, generator=g, dtype=torch.float64)
    dy, dc = (torch.randn(3, length, d, generator=g, dtype=torch.float64).half().double()
              for _ in range(2))
    scale = d**0.5
    torch.manual_seed(9)
    keep = embedding(torch.zeros_like(tokens), torch.ones(1, d), torch.zeros(length, d),
                         dropout_p=p) != 0
    assert _keep_rate_ok(keep, p)
    torch.manual_seed(9)
    ours = _outputs_and_grads(lambda w, positions: embedding(
        tokens, w, positions, scale, p, copy_dtype=torch.float16), [weight.float()], [dy, dc],
        positions=positions.float())

    def reference(w, positions):
        y = embedding_reference(tokens, w, positions, scale, keep, p)
        return y, y if y.dtype == torch.float64 else y.half()

    exact = _outputs_and_grads(reference, [weight], [dy, dc], positions=positions)
    own = _outputs_and_grads(reference, [weight.float()], [dy, dc], positions=positions.float())
    assert torch.equal(ours[1], ours[0].half())
    _grade(ours, exact, own, ["y", "copy", "dweight"])


@pytest.mark.skipif(not implementation("attention", "cpu", torch.float16, True)
                    .startswith("triton"), reason="runs the Triton kernels themselves, on CPU "
                                                  "tensors only under the interpreter")
def test_key_value_output_and_grad_rows_past_2_to_the_31_elements(seeded):
    """Keys, values, the output and its gradient whose row 2 lies past element 2**31 of its
    buffer (the row stride times the row index passes 2**31; gpu_check's far_rows for k, v
    and dO): the kernels give what they give on compact tensors, bit for bit. The buffers are
    virtual: only the rows the views cover are written."""
    from fastattn.kernels import attention as kernels

    length, row = 3, 2**30 + 64

    def far_apart(compact):
        buffer = torch.empty(row * (length - 1) + compact.shape[-1], dtype=compact.dtype)
        return buffer.as_strided(compact.shape, (0, 0, row, 1)).copy_(compact)

    q, k, v, grad_out = (torch.randn(1, 1, length, D, dtype=torch.float16) for _ in range(4))
    mask = torch.tensor([[[[True, False, True]]]])
    scale = D**-0.5
    for causal in (None, "bottom_right"):
        out, lse = kernels.attention_forward(q, k, v, mask, None, causal, 0.0, scale)
        far_out, far_lse = kernels.attention_forward(q, far_apart(k), far_apart(v), mask, None,
                                                     causal, 0.0, scale)
        assert torch.equal(far_out, out) and torch.equal(far_lse, lse)
        grads = kernels.attention_backward(grad_out, q, k, v, out, lse, mask, None, causal, 0.0,
                                           scale)
        far_grads = kernels.attention_backward(far_apart(grad_out), q, far_apart(k), far_apart(v),
                                               far_apart(out), lse, mask, None, causal, 0.0,
                                               scale)
        assert all(torch.equal(a, b) for a, b in zip(far_grads, grads, strict=True))
