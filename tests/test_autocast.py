"""What spares autocast's casts gives autocast's loss and gradients bit for bit:
fastattn.autocast.batched_weight_casts (one cast per layer of its weights; the parameters
untouched and restored; nothing without autocast) and the LayerNorm kernels' copies of their
outputs in autocast's dtype (fastattn.fused_model.Stream). benchmarks/launches.py counts the
launches they save on the CUDA path."""

import contextlib
from dataclasses import replace

import pytest
import torch
from torch import nn

import fastattn.autocast
import fastattn.backend
import fastattn.fused_model
import fastattn.model
import fastattn.ops
from fastattn.autocast import batched_weight_casts
from fastattn.model import Transformer, TransformerConfig
from fastattn.rdrop import rdrop_loss

TINY = TransformerConfig(vocab_size=53, encoder_layers=2, decoder_layers=2, d_model=32, d_ff=48,
                         heads=4, dropout=0.1, pad_id=0)


def batch():
    g = torch.Generator().manual_seed(3)
    src, tgt = torch.randint(3, 53, (3, 7), generator=g), torch.randint(3, 53, (3, 6), generator=g)
    src[1, 4:] = 0
    tgt[2, 3:] = 0
    return src, tgt[:, :-1], tgt[:, 1:]


def loss_and_grads(model, rdrop, dtype=torch.bfloat16):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks
    with torch.autocast("cpu", dtype):
        loss = rdrop_loss(model, *batch(), 0.5, reduction="sum") if rdrop else \
            model.loss(*batch(), reduction="sum")
    (loss * 3.7).backward()  # a gradient that is not 1
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("rdrop", [False, True])
def test_batched_casts_give_autocasts_loss_and_gradients_bit_for_bit(rdrop, monkeypatch):
    torch.manual_seed(0)
    model = Transformer(TINY).train()
    calls = []
    apply = fastattn.autocast._CastAll.apply
    monkeypatch.setattr(fastattn.autocast._CastAll, "apply",
                        lambda *a: calls.append(len(a) - 1) or apply(*a))
    batched, batched_grads = loss_and_grads(model, rdrop)
    # One cast on one process: every linear map's weight and bias, 4 maps per encoder layer and
    # 7 per decoder layer; under torch.distributed the memory projections first, then per layer.
    assert calls == [4 * 2 * 2 + 7 * 2 * 2]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    calls.clear()
    per_layer, per_layer_grads = loss_and_grads(model, rdrop)
    assert calls == [4, 8, 8, 12, 12]
    monkeypatch.undo()
    monkeypatch.setattr(fastattn.model, "batched_weight_casts",
                        lambda *a: contextlib.nullcontext())
    plain, plain_grads = loss_and_grads(model, rdrop)
    assert torch.equal(batched, plain) and torch.equal(per_layer, plain)
    assert batched_grads.keys() == plain_grads.keys() == per_layer_grads.keys()
    for name, grad in batched_grads.items():
        assert grad.dtype == torch.float32, name
        assert torch.equal(grad, plain_grads[name]), name
        assert torch.equal(per_layer_grads[name], plain_grads[name]), name


# Triton's interpreter rounds float32 to bfloat16 toward zero (a GPU, like y.to(), to nearest
# even), so there the bfloat16 copies differ in the last bit: float16 checks the kernels.
@pytest.mark.parametrize("dtype", [
    torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        fastattn.backend.interpreter_active(), reason="the interpreter rounds to bf16 toward "
        "zero; the float16 case checks the kernels"))])
@pytest.mark.parametrize("rdrop", [False, True])
@pytest.mark.parametrize("pre_norm", [False, True])
def test_layer_norm_copies_give_autocasts_loss_and_gradients_bit_for_bit(dtype, rdrop, pre_norm,
                                                                           monkeypatch):
    torch.manual_seed(0)
    model = Transformer(replace(TINY, pre_norm=pre_norm)).train()
    monkeypatch.setattr(fastattn.fused_model, "PER_OP_DEVICES", ())  # a GPU's path, on the CPU
    copies = []
    layer_norm = fastattn.ops.layer_norm_residual
    monkeypatch.setattr(fastattn.ops, "layer_norm_residual", lambda *a, copy_dtype=None, **k: (
        copies.append(copy_dtype), layer_norm(*a, copy_dtype=copy_dtype, **k))[1])
    copied, copied_grads = loss_and_grads(model, rdrop, dtype)
    # Post-norm: every sub-layer's LayerNorm writes a copy (2 per encoder layer, 3 per decoder
    # layer); pre-norm stacks have no such LayerNorm.
    assert copies == ([] if pre_norm else [dtype] * 10)
    monkeypatch.setattr(fastattn.fused_model, "autocast_copy_dtype", lambda x: None)
    plain, plain_grads = loss_and_grads(model, rdrop, dtype)
    assert torch.equal(copied, plain)
    for name, grad in copied_grads.items():
        assert torch.equal(grad, plain_grads[name]), name


def test_no_layer_norm_copies_on_a_cpu():
    x = torch.randn(2, 3)
    with torch.autocast("cpu", torch.bfloat16):
        assert fastattn.fused_model.autocast_copy_dtype(x) is None


def test_copies_shadow_the_parameters_only_inside_the_block():
    layer = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3, bias=False))
    weights = [p for p in layer.parameters()]
    with torch.autocast("cpu", torch.bfloat16), batched_weight_casts([layer], "cpu"):
        assert layer[0].weight.dtype == torch.bfloat16 and layer[0].bias.dtype == torch.bfloat16
        assert layer[2].weight.dtype == torch.bfloat16 and layer[2].bias is None
        assert torch.equal(layer[0].weight, weights[0].detach().bfloat16())
        assert list(layer.parameters()) == weights  # the optimiser's view is unchanged
        y = layer(torch.randn(2, 4))
    assert y.dtype == torch.bfloat16
    assert [layer[0].weight, layer[0].bias, layer[2].weight] == weights
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in weights)

    with pytest.raises(RuntimeError, match="inside"):
        with torch.autocast("cpu", torch.bfloat16), batched_weight_casts([layer], "cpu"):
            raise RuntimeError("inside")
    assert layer[0].weight is weights[0]  # restored after an exception too


def test_without_autocast_nothing_changes():
    layer = nn.Linear(4, 5)
    with batched_weight_casts([layer], "cpu"):
        assert layer.weight is layer._parameters["weight"]
    with torch.autocast("cpu", torch.bfloat16, enabled=False), batched_weight_casts([layer],
                                                                                     "cpu"):
        assert layer.weight.dtype == torch.float32


def test_weights_cast_per_layer_under_torch_distributed_else_at_once(monkeypatch):
    """One group (the fewest launches) on one process; under torch.distributed the memory
    projections' group first, then one per layer, each module in exactly one group."""
    model = Transformer(TINY)
    layers = [*model.encoder.layers, *model.decoder.layers]
    [whole] = fastattn.fused_model.weight_cast_groups(model)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    memory_kv, *per_layer = fastattn.fused_model.weight_cast_groups(model)
    assert memory_kv == [layer.cross_attention.kv for layer in model.decoder.layers]
    assert per_layer == [[layer] for layer in layers]
    assert whole == memory_kv + layers


def test_a_module_in_a_group_twice_is_cast_once():
    layer = nn.Linear(4, 5)
    with torch.autocast("cpu", torch.bfloat16), batched_weight_casts([[layer, layer]], "cpu"):
        assert layer.weight.dtype == torch.bfloat16
        layer(torch.randn(2, 4)).float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32
