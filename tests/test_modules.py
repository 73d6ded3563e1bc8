"""fastattn.modules against PyTorch: MultiHeadAttention is a drop-in for nn.MultiheadAttention,
ResidualLayerNorm and LabelSmoothedCrossEntropy match their unfused definitions."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastattn.modules import (
    LabelSmoothedCrossEntropy,
    MultiHeadAttention,
    ResidualLayerNorm,
    replace_multihead_attention,
)

E, H, L, S, N = 12, 3, 5, 7, 2  # odd sizes: head_dim 4, L != S
TOL = {"atol": 1e-5, "rtol": 1e-4}


def assert_grad_close(ours, theirs):
    """Gradients of weights sum over every row, and float32 sums of terms that cancel are
    accurate to the terms' scale, not the result's: the absolute tolerance follows the tensor's
    largest magnitude."""
    atol = TOL["atol"] * max(1.0, float(theirs.abs().max()) if theirs.numel() else 0.0)
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=TOL["rtol"])


def make_pair(seed=0, **kwargs):
    """A torch module with random weights (biases too) and our copy loaded from its state_dict."""
    torch.manual_seed(seed)
    theirs = nn.MultiheadAttention(E, H, **kwargs)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.5)
    ours = MultiHeadAttention(E, H, **kwargs)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def make_inputs(kdim=E, vdim=E, batch_first=False, unbatched=False, n=N, l=L, s=S):
    def shape(length, dim):
        if unbatched:
            return (length, dim)
        return (n, length, dim) if batch_first else (length, n, dim)

    return (torch.randn(shape(l, E)), torch.randn(shape(s, kdim)), torch.randn(shape(s, vdim)))


def run(module, inputs, grad_out, kwargs, self_attention=False):
    """Forward and backward; returns output, weights and gradients of inputs and parameters."""
    inputs = [x.clone().requires_grad_() for x in inputs]
    if self_attention:  # the same tensor three times, so the packed projection path runs
        q = k = v = inputs[0]
    else:
        q, k, v = inputs
    out, weights = module(q, k, v, **kwargs)
    (out * grad_out).sum().backward()
    grads = [x.grad for x in inputs] + [p.grad for p in module.parameters()]
    module.zero_grad()
    return out, weights, grads


def assert_parity(theirs, ours, inputs, kwargs, self_attention=False, valid_rows=None):
    """Same outputs, weights and gradients. valid_rows (output-shaped bool) leaves out query rows
    whose keys are all masked: torch may give NaN there, we give zeros (checked separately)."""
    grad_out = torch.randn_like(theirs(*inputs, **kwargs)[0]) * 0.7
    if valid_rows is not None:
        grad_out = grad_out * valid_rows
    out_t, w_t, grads_t = run(theirs, inputs, grad_out, kwargs, self_attention)
    out_o, w_o, grads_o = run(ours, inputs, grad_out, kwargs, self_attention)
    assert out_o.shape == out_t.shape
    if valid_rows is None:
        torch.testing.assert_close(out_o, out_t, **TOL)
    else:
        torch.testing.assert_close(out_o[valid_rows], out_t[valid_rows], **TOL)
    if w_t is None:
        assert w_o is None
    elif valid_rows is None:
        torch.testing.assert_close(w_o, w_t, **TOL)
    for g_o, g_t in zip(grads_o, grads_t, strict=True):
        assert (g_o is None) == (g_t is None)
        if g_t is not None and valid_rows is None:
            assert_grad_close(g_o, g_t)


CONFIGS = {
    "default": {},
    "batch_first": {"batch_first": True},
    "kdim_vdim": {"kdim": 5, "vdim": 9},
    "kdim_vdim_batch_first": {"kdim": 5, "vdim": 9, "batch_first": True},
    "no_bias": {"bias": False},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "bias_kv_zero_attn_no_bias": {"add_bias_kv": True, "add_zero_attn": True, "bias": False},
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("need_weights", [False, True])
def test_parity_configurations(config, need_weights):
    theirs, ours = make_pair(**config)
    inputs = make_inputs(config.get("kdim", E), config.get("vdim", E), config.get("batch_first"))
    assert_parity(theirs, ours, inputs, {"need_weights": need_weights})


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_parity_self_attention_packed_projection(batch_first, need_weights):
    theirs, ours = make_pair(batch_first=batch_first)
    inputs = make_inputs(batch_first=batch_first, s=L)
    kwargs = {"need_weights": need_weights, "attn_mask": causal_bool(L, L)}
    assert_parity(theirs, ours, inputs, kwargs, self_attention=True)


def test_parity_shared_key_value():
    theirs, ours = make_pair()
    q, k, _ = make_inputs()
    for module in (theirs, ours):
        module.zero_grad()
    kv_t, kv_o = k.clone().requires_grad_(), k.clone().requires_grad_()
    out_t, _ = theirs(q, kv_t, kv_t, need_weights=False)
    out_o, _ = ours(q, kv_o, kv_o, need_weights=False)
    torch.testing.assert_close(out_o, out_t, **TOL)
    grad_out = torch.randn_like(out_t)
    (out_t * grad_out).sum().backward()
    (out_o * grad_out).sum().backward()
    assert_grad_close(kv_o.grad, kv_t.grad)
    assert_grad_close(ours.in_proj_weight.grad, theirs.in_proj_weight.grad)


def causal_bool(l, s):
    """torch convention: True = masked."""
    return torch.ones(l, s, dtype=torch.bool).triu(1)


def random_bool(*shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=g) < 0.4
    mask[..., 0] = False  # every row keeps a key, so torch has no NaN rows to compare against
    return mask


def random_float(*shape, seed=2):
    g = torch.Generator().manual_seed(seed)
    masked = random_bool(*shape, seed=seed)
    return torch.randn(shape, generator=g).masked_fill(masked, float("-inf"))


MASKS = {
    "attn_bool_2d": lambda: {"attn_mask": random_bool(L, S)},
    "attn_float_2d": lambda: {"attn_mask": random_float(L, S)},
    "attn_bool_3d": lambda: {"attn_mask": random_bool(N * H, L, S)},
    "attn_float_3d": lambda: {"attn_mask": random_float(N * H, L, S)},
    "padding_bool": lambda: {"key_padding_mask": random_bool(N, S)},
    "padding_float": lambda: {"key_padding_mask": random_float(N, S)},
    "both_bool": lambda: {"attn_mask": random_bool(L, S), "key_padding_mask": random_bool(N, S)},
    "both_float_3d": lambda: {
        "attn_mask": random_float(N * H, L, S), "key_padding_mask": random_float(N, S)
    },
}


@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("extras", [{}, {"add_bias_kv": True, "add_zero_attn": True}],
                         ids=["plain", "bias_kv_zero_attn"])
def test_parity_masks(mask, need_weights, extras):
    theirs, ours = make_pair(**extras)
    assert_parity(theirs, ours, make_inputs(), {"need_weights": need_weights, **mask()})


def test_parity_mixed_bool_and_float_masks():
    theirs, ours = make_pair(batch_first=True)
    kwargs = {"attn_mask": random_bool(L, S), "key_padding_mask": random_float(N, S),
              "need_weights": False}
    with pytest.warns(UserWarning):  # torch deprecates mixing; we accept it silently
        assert_parity(theirs, ours, make_inputs(batch_first=True), kwargs)


@pytest.mark.parametrize("average", [True, False])
def test_parity_weights_per_head_or_averaged(average):
    theirs, ours = make_pair(add_bias_kv=True)
    kwargs = {"need_weights": True, "average_attn_weights": average,
              "key_padding_mask": random_bool(N, S)}
    _, w = ours(*make_inputs(), **kwargs)
    assert w.shape == ((N, L, S + 1) if average else (N, H, L, S + 1))
    assert_parity(theirs, ours, make_inputs(), kwargs)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "2d", "3d", "padding"])
def test_parity_unbatched(need_weights, mask_kind):
    theirs, ours = make_pair(batch_first=True, kdim=5, vdim=9)
    masks = {
        "none": {},
        "2d": {"attn_mask": random_bool(L, S)},
        "3d": {"attn_mask": random_float(H, L, S)},
        "padding": {"key_padding_mask": random_bool(S)},
    }
    inputs = make_inputs(kdim=5, vdim=9, unbatched=True)
    out, w = ours(*inputs, need_weights=True, **masks[mask_kind])
    assert out.shape == (L, E) and w.shape == (L, S)
    assert_parity(theirs, ours, inputs, {"need_weights": need_weights, **masks[mask_kind]})


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_parity_is_causal_with_mask(need_weights, padding):
    """torch's hint semantics: with a (causal) mask, is_causal=True gives the same result."""
    theirs, ours = make_pair()
    kwargs = {"attn_mask": causal_bool(L, L), "is_causal": True, "need_weights": need_weights}
    if padding:
        kwargs["key_padding_mask"] = random_bool(N, L)
    assert_parity(theirs, ours, make_inputs(s=L), kwargs)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("unbatched", [False, True])
def test_is_causal_without_mask_means_causal(need_weights, unbatched):
    theirs, ours = make_pair(add_zero_attn=True)
    inputs = make_inputs(s=L, unbatched=unbatched)
    # torch with its hint: the mask is dropped and causality covers the extra (zero) key too
    expected, _ = theirs(*inputs, attn_mask=causal_bool(L, L), is_causal=True, need_weights=False)
    out, _ = ours(*inputs, is_causal=True, need_weights=need_weights)
    torch.testing.assert_close(out, expected, **TOL)
    with pytest.raises(RuntimeError, match="attn_mask"):  # what we extend: torch refuses this
        theirs(*inputs, is_causal=True)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zeros(need_weights, kind):
    theirs, ours = make_pair(bias=False)
    mask = random_bool(N, S)
    mask[1] = True  # sentence 1 has no key at all
    if kind == "float":
        mask = torch.zeros(N, S).masked_fill(mask, float("-inf"))
    inputs = make_inputs(batch_first=False)
    valid = torch.ones(L, N, E, dtype=torch.bool)
    valid[:, 1] = False
    kwargs = {"key_padding_mask": mask, "need_weights": need_weights}
    out, w = ours(*inputs, **kwargs)
    assert torch.equal(out[:, 1], torch.zeros(L, E))
    if need_weights:
        assert torch.equal(w[1], torch.zeros(L, S))
    assert_parity(theirs, ours, inputs, kwargs, valid_rows=valid)
    # the gradient through the empty rows is zero, not NaN
    q, k, v = (x.clone().requires_grad_() for x in inputs)
    ours(q, k, v, **kwargs)[0].sum().backward()
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all()
    assert torch.equal(q.grad[:, 1], torch.zeros(L, E))


def test_dropout_acts_only_in_training():
    theirs, ours = make_pair(dropout=0.5)
    inputs = make_inputs()
    ours.eval()
    theirs.eval()
    torch.testing.assert_close(ours(*inputs)[0], theirs(*inputs)[0], **TOL)
    ours.train()
    torch.manual_seed(0)
    out, w = ours(*inputs, need_weights=True, average_attn_weights=False)
    kept = w != 0
    assert 0.2 < kept.float().mean() < 0.8  # about half the weights dropped ...
    assert torch.allclose(w.sum(-1).mean(), torch.tensor(1.0), atol=0.3)  # ... and rescaled
    torch.manual_seed(0)
    assert not torch.allclose(ours(*inputs, need_weights=False)[0], out)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_state_dict_loads_strictly_both_ways(config):
    theirs, ours = make_pair(**config)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    torch.manual_seed(5)
    fresh = nn.MultiheadAttention(E, H, **config)
    fresh.load_state_dict(ours.state_dict(), strict=True)
    for a, b in zip(fresh.state_dict().values(), theirs.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_initialisation_matches_torch(config):
    torch.manual_seed(3)
    theirs = nn.MultiheadAttention(E, H, **config)
    torch.manual_seed(3)
    ours = MultiHeadAttention(E, H, **config)
    for (name, a), b in zip(theirs.state_dict().items(), ours.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_factory_kwargs():
    ours = MultiHeadAttention(E, H, dtype=torch.float64, device="cpu")
    assert all(p.dtype == torch.float64 for p in ours.parameters())
    q = torch.randn(L, N, E, dtype=torch.float64)
    assert ours(q, q, q)[0].dtype == torch.float64


def test_bad_inputs_raise_clear_errors():
    _, ours = make_pair()
    q, k, v = make_inputs()
    with pytest.raises(ValueError, match="not divisible"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="features"):
        ours(q[..., :5], k, v)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        ours(q, k, v, key_padding_mask=torch.zeros(N, S + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        ours(q, k, v, attn_mask=torch.zeros(N, L, S, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool and floating"):
        ours(q, k, v, attn_mask=torch.zeros(L, S, dtype=torch.long))
    with pytest.raises(ValueError, match="3-D like query"):
        ours(q, k[0], v)


class TorchModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0)
        self.cross = nn.MultiheadAttention(E, H, kdim=5, vdim=9, batch_first=True)
        self.shared = nn.ModuleList([self.cross])  # the same module reachable twice

    def forward(self, x, memory_k, memory_v):
        y = self.layer(x.transpose(0, 1)).transpose(0, 1)
        return self.cross(y, memory_k, memory_v, need_weights=False)[0]


def test_replace_multihead_attention_in_place_keeps_weights_and_outputs():
    torch.manual_seed(0)
    model = TorchModel()
    x, k, v = torch.randn(N, L, E), torch.randn(N, S, 5), torch.randn(N, S, 9)
    expected = model(x, k, v)
    state = model.state_dict()
    assert replace_multihead_attention(model) is model
    assert type(model.layer.self_attn) is MultiHeadAttention
    assert type(model.cross) is MultiHeadAttention and model.shared[0] is model.cross
    assert not any(type(m) is nn.MultiheadAttention for m in model.modules())
    assert model.state_dict().keys() == state.keys()
    torch.testing.assert_close(model(x, k, v), expected, **TOL)
    single = replace_multihead_attention(nn.MultiheadAttention(E, H).eval())
    assert type(single) is MultiHeadAttention and not single.training


def test_residual_layer_norm_matches_definition():
    torch.manual_seed(0)
    norm = ResidualLayerNorm(13, dropout=0.3)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x, residual = torch.randn(2, 3, 5, 13)
    norm.eval()  # no dropout outside training
    weight, bias = norm.weight.double(), norm.bias.double()
    expected = F.layer_norm((residual + x).double(), (13,), weight, bias, 1e-5).float()
    torch.testing.assert_close(norm(x, residual), expected, atol=1e-5, rtol=1e-5)
    assert set(dict(norm.named_parameters())) == set(dict(nn.LayerNorm(13).named_parameters()))
    norm.train()
    y = norm(x, residual)
    assert not torch.allclose(y, expected)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothed_cross_entropy_matches_torch(reduction):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    logits64 = logits.detach().double().requires_grad_()
    target = torch.randint(0, 11, (3, 5))
    target[0, :2] = 0
    loss = LabelSmoothedCrossEntropy(0.1, ignore_index=0, reduction=reduction)(logits, target)
    expected = F.cross_entropy(logits64.transpose(1, 2), target, ignore_index=0,
                               label_smoothing=0.1, reduction=reduction)
    tol = {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(loss, expected.float(), **tol)
    grad = torch.randn_like(expected) * 0.5 + 0.3
    (g_ours,) = torch.autograd.grad(loss, logits, grad.float())
    (g_ref,) = torch.autograd.grad(expected, logits64, grad)
    torch.testing.assert_close(g_ours, g_ref.float(), **tol)
    with pytest.raises(ValueError, match="class"):
        LabelSmoothedCrossEntropy()(logits, target[:, :3])


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # torch, odd head count
@pytest.mark.parametrize("training", [True, False])
def test_converted_nn_transformer_matches_the_original(training):
    """nn.Transformer calls its attention with causal hints and padding masks; in eval under
    no_grad its encoder takes torch's fast path, which reads our parameters and merge_masks."""
    torch.manual_seed(0)
    theirs = nn.Transformer(E, H, 2, 2, 16, dropout=0.0, batch_first=True).train(training)
    ours = replace_multihead_attention(copy.deepcopy(theirs))
    assert sum(type(m) is MultiHeadAttention for m in ours.modules()) == 6
    src, tgt = torch.randn(N, S, E), torch.randn(N, L, E)
    padding = torch.zeros(N, S, dtype=torch.bool)
    padding[1, 4:] = True
    kwargs = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(L), "tgt_is_causal": True,
              "src_key_padding_mask": padding, "memory_key_padding_mask": padding}
    with torch.set_grad_enabled(training):
        expected, out = theirs(src, tgt, **kwargs), ours(src, tgt, **kwargs)
    torch.testing.assert_close(out, expected, **TOL)
    if training:
        grad = torch.randn_like(out)
        (out * grad).sum().backward()
        (expected * grad).sum().backward()
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, **TOL, msg=name)


# The op contract at its edges (issue 50 item 9), against torch's module itself.
EMPTY_SIZES = {"L=0": dict(l=0), "S=0": dict(s=0), "N=0": dict(n=0), "L=S=0": dict(l=0, s=0)}


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("config", ["default", "bias_kv", "zero_attn", "batch_first"])
@pytest.mark.parametrize("sizes", EMPTY_SIZES.values(), ids=EMPTY_SIZES.keys())
def test_empty_sequences_give_what_torch_gives(sizes, config, padding, need_weights):
    """L, S or N = 0: torch's output, weights and gradients, S = 0 being attention to no key
    (zeros before out_proj). Where torch's fused path itself fails on an empty key padding mask
    (a reshape of 0 elements), ours gives what torch's need_weights=True path gives."""
    kwargs = CONFIGS[config]
    theirs, ours = make_pair(**kwargs)
    size = dict(n=N, l=L, s=S) | sizes
    inputs = make_inputs(batch_first=kwargs.get("batch_first", False), **size)
    call = {"need_weights": need_weights}
    if padding:
        call["key_padding_mask"] = torch.zeros(size["n"], size["s"], dtype=torch.bool)
    try:
        theirs(*inputs, **call)
    except RuntimeError as e:  # torch's own bug: compare with its explicit path instead
        assert "0 elements" in str(e) and padding and not need_weights
        reference = dict(call, need_weights=True)
        grad_out = torch.randn_like(theirs(*inputs, **reference)[0])
        out_t, _, grads_t = run(theirs, inputs, grad_out, reference)
        out_o, w_o, grads_o = run(ours, inputs, grad_out, call)
        assert w_o is None
        torch.testing.assert_close(out_o, out_t, **TOL)
        for g_o, g_t in zip(grads_o, grads_t, strict=True):
            assert (g_o is None) == (g_t is None)
            if g_t is not None:
                assert_grad_close(g_o, g_t)
        return
    assert_parity(theirs, ours, inputs, call)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("which", ["attn_mask", "key_padding_mask"])
def test_float_masks_get_no_gradient_on_either_path(need_weights, which):
    """Masks are constants in fastattn (torch's module gives a float mask a gradient): the same
    on the fused path and on the explicit one that returns the weights."""
    _, ours = make_pair()
    inputs = make_inputs()
    mask = (torch.randn(L, S) if which == "attn_mask" else torch.randn(N, S)).requires_grad_()
    q, k, v = (x.clone().requires_grad_() for x in inputs)
    out, _ = ours(q, k, v, need_weights=need_weights, **{which: mask})
    out.sum().backward()
    assert mask.grad is None and q.grad is not None and k.grad is not None
