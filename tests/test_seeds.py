"""fastattn.ops.seeds, the fused ops' dropout seeds: drawn from torch's generator, or slots of a
device table (from_device) that the Triton kernels read through a pointer. The kernel tests run
under FASTATTN_BACKEND=triton TRITON_INTERPRET=1, where a one-element CPU int64 tensor passed to
a launcher reaches the kernel as a pointer (the ops pass CPU seeds by value)."""

import pytest
import torch

from fastattn.backend import implementation, interpreter_active
from fastattn.ops import attention, layer_norm_residual, seeds
from fastattn.ops.embedding import embedding

interpreted = pytest.mark.skipif(not interpreter_active(), reason="the Triton kernels themselves, "
                                 "on CPU tensors only under the interpreter")


def test_draw_comes_from_torchs_generator():
    torch.manual_seed(5)
    a = seeds.draw(2)
    torch.manual_seed(5)
    assert torch.equal(seeds.draw(2), a)
    assert a.dtype == torch.int64 and a.device.type == "cpu" and a.shape == (2,)
    assert ((a >= 0) & (a < 2**62)).all()
    assert not torch.equal(seeds.draw(2), a)


def test_from_device_hands_out_consecutive_slots_and_refill_starts_over():
    table = seeds.DeviceSeeds("cpu")
    with seeds.from_device(table) as active:
        assert active is table
        first, second = seeds.draw(2), seeds.draw(1)  # the eager pass sizes the table
    assert len(table.table) == 3
    assert torch.equal(torch.cat([first, second]), table.table)
    sized = table.table.clone()
    table.refill()
    assert table.taken == 0 and not torch.equal(table.table, sized)
    with seeds.from_device(table):
        first, second = seeds.draw(2), seeds.draw(1)
    # Views of slots 0 and 2, not copies: what a refill writes, the kernels read.
    assert first.data_ptr() == table.table.data_ptr()
    assert second.data_ptr() == table.table[2:].data_ptr()
    before = first.clone()
    table.refill()
    assert not torch.equal(first, before)


def test_a_pass_taking_more_grows_the_table_and_keeps_its_slots():
    table = seeds.DeviceSeeds("cpu")
    with seeds.from_device(table):
        seeds.draw(2)
    table.refill()
    kept = table.table.clone()
    with seeds.from_device(table):
        seeds.draw(2)
        grown = seeds.draw(3)
    assert len(table.table) == 5 and torch.equal(table.table[:2], kept)
    assert torch.equal(grown, table.table[2:])


def test_from_device_restores_the_outer_source():
    outer, inner = seeds.DeviceSeeds("cpu"), seeds.DeviceSeeds("cpu")
    with seeds.from_device(outer):
        with seeds.from_device(inner):
            seeds.draw(1)
        seeds.draw(1)
        with pytest.raises(KeyError), seeds.from_device(inner):
            raise KeyError
        seeds.draw(1)
    assert (outer.taken, inner.taken) == (2, 1)
    torch.manual_seed(9)
    drawn = seeds.draw(1)
    torch.manual_seed(9)
    assert torch.equal(drawn, torch.randint(0, 2**62, (1,), dtype=torch.int64))


def test_kernel_argument_is_a_cpu_seeds_value_and_a_device_seed_itself():
    assert seeds.kernel_argument(None) == 0
    assert seeds.kernel_argument(torch.tensor([2**61 + 3])) == 2**61 + 3
    on_device = torch.empty(1, dtype=torch.int64, device="meta")
    assert seeds.kernel_argument(on_device) is on_device


def _ops_outputs(op: str) -> torch.Tensor:
    """One dropout call of `op` on fixed inputs; its mask is all that varies with the seed."""
    g = torch.Generator().manual_seed(0)
    if op == "layer_norm_residual":
        x = torch.randn(6, 40, generator=g)
        return layer_norm_residual(x, torch.randn(6, 40, generator=g), None, None,
                                   dropout_p=0.5)
    if op == "embedding":
        return embedding(torch.randint(0, 9, (2, 5), generator=g), torch.randn(9, 16, generator=g),
                         torch.randn(5, 16, generator=g), dropout_p=0.5)
    q, k, v = torch.randn(3, 1, 2, 9, 16, generator=g)
    return attention(q, k, v, dropout_p=0.5)


@pytest.mark.triton
@pytest.mark.parametrize("op", ["layer_norm_residual", "embedding", "attention"])
def test_ops_inside_from_device_take_their_seeds_from_the_table(op):
    """Each pass's masks follow the table's values (a refill draws new ones), not torch's CPU
    generator, which the ops inside from_device leave alone."""
    if {implementation(name, "cpu", torch.float32) for name in (op, "dropout")} == {"torch"}:
        pytest.skip(f"{op} draws its mask with torch.rand here (no fastattn._C)")
    table = seeds.DeviceSeeds("cpu")

    def run(refill_seed: int) -> torch.Tensor:
        torch.manual_seed(refill_seed)
        table.refill()
        torch.manual_seed(0)  # the same for every pass: only the table may change the masks
        with seeds.from_device(table):
            out = _ops_outputs(op)
        assert table.taken == len(table.table)
        return out

    run(0)  # sizes the table
    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))


# The launchers given a seed as a pointer (a one-element int64 tensor, here a slot in the middle
# of a table, as DeviceSeeds hands out) give bit for bit what they give for its value.

def _table_slots(start: int, n: int) -> torch.Tensor:
    return torch.randint(0, 2**62, (5,), dtype=torch.int64)[start:start + n]


@pytest.mark.triton
@interpreted
@pytest.mark.parametrize("n", [40, 4099])  # the one-pass and the two-pass (wide) backward
def test_layer_norm_kernels_read_a_seed_through_a_pointer(seeded, n):
    from fastattn.kernels import layer_norm as kernels

    x, residual, dy = torch.randn(3, 5, n)
    weight, bias = torch.randn(2, n)
    seed = _table_slots(2, 1)
    results = []
    for argument in (int(seed), seed):
        y, s, _, mean, rstd = kernels.layer_norm_residual_forward(
            x, residual, weight, bias, argument, 1e-5, 0.3, True)
        grads = kernels.layer_norm_residual_backward(dy, None, x, residual, weight, True,
                                                     argument, mean, rstd, 0.3)
        results.append((y, s, mean, rstd, *grads))
    assert (results[0][1] != residual).any()  # dropout dropped something
    for by_value, by_pointer in zip(*results, strict=True):
        assert torch.equal(by_value, by_pointer)


@pytest.mark.triton
@interpreted
def test_embedding_kernels_read_a_seed_through_a_pointer(seeded):
    from fastattn.kernels import embedding as kernels

    tokens = torch.randint(0, 37, (2 * 17,))
    weight, positions = torch.randn(37, 24), torch.randn(17, 24)
    dy, dy_copy = torch.randn(2, 2 * 17, 24)
    seed = _table_slots(3, 1)
    results = []
    for argument in (int(seed), seed):
        y, y_copy = kernels.embedding_forward(tokens, weight, positions, argument, 2.0, 0.3,
                                              torch.float16)
        dw = kernels.embedding_backward(dy, dy_copy.half(), tokens, argument, 37, 2.0, 0.3,
                                        torch.float32)
        results.append((y, y_copy, dw))
    assert (results[0][0] == 0).any()
    for by_value, by_pointer in zip(*results, strict=True):
        assert torch.equal(by_value, by_pointer)


@pytest.mark.triton
@interpreted
def test_attention_kernels_read_seed_and_offset_through_pointers(seeded, monkeypatch):
    """The launchers pass an rng on the GPU as pointers to its two elements; here a CPU one is
    passed so (the interpreter reads CPU memory) and compared with its values."""
    from fastattn.kernels import attention as kernels

    q = torch.randn(1, 2, 17, 16)
    k, v = torch.randn(2, 1, 2, 33, 16)
    grad_out = torch.randn(1, 2, 17, 16)
    mask = torch.rand(1, 1, 1, 33) > 0.2  # key padding
    mask[..., 0] = True
    rng = _table_slots(1, 2)
    results = []
    for pointers in (False, True):
        if pointers:
            monkeypatch.setattr(kernels, "_philox_args", lambda rng, p: (rng, rng[1:]))
        out, lse = kernels.attention_forward(q, k, v, mask, rng, "top_left", 0.3, 0.25)
        grads = kernels.attention_backward(grad_out, q, k, v, out, lse, mask, rng, "top_left",
                                           0.3, 0.25)
        keep = kernels.dropout_keep_mask(1, 2, 17, 33, 0.3, rng, q.device)
        results.append((out, lse, *grads, keep))
    assert not results[0][-1].all()
    for by_value, by_pointer in zip(*results, strict=True):
        assert torch.equal(by_value, by_pointer)
