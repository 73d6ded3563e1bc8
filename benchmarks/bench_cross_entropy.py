"""Label-smoothed cross-entropy (smoothing 0.1, the paper's, with 10% padding targets ignored)
against F.cross_entropy, and the fused output projection + loss against F.linear followed by
F.cross_entropy: forward and forward+backward, with peak memory.

The loss alone is memory-bound: its rate is effective bandwidth over the minimal traffic, one read
of the (N, V) logits forward and one write of their gradient backward. The projection + loss is
compute-bound: 2NEV FLOP forward, 6NEV forward+backward; what fusion buys is memory, since the
(N, V) logits never exist in full.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import DEVICE, DTYPES, QUICK, measure
from fastattn.ops import label_smoothed_cross_entropy, linear_cross_entropy

SMOOTHING = 0.1
# (tokens, vocabulary): a small vocabulary, the paper's shared ~37k BPE, a 128k vocabulary.
LOSS_CASES = [(64, 1000), (17, 4099)] if QUICK else [(4096, 8192), (4096, 37000), (1024, 131072)]
# (tokens, d_model, vocabulary): base's output layer at the paper's per-GPU target tokens, and
# the default run's (multi30k, its 5,455 target-side pieces) at its batch's target tokens.
PROJECTION_CASES = [(64, 32, 1000)] if QUICK else [(3125, 512, 37000), (8120, 128, 5455)]


def targets(tokens: int, vocab: int) -> torch.Tensor:
    target = torch.randint(0, vocab, (tokens,), device=DEVICE)
    target[torch.rand(tokens, device=DEVICE) < 0.1] = -100
    return target


LOSSES = {
    "fastattn": lambda logits, t: label_smoothed_cross_entropy(logits, t, smoothing=SMOOTHING),
    "torch": lambda logits, t: F.cross_entropy(logits, t, label_smoothing=SMOOTHING),
}

PROJECTIONS = {
    "fastattn": lambda h, w, t: linear_cross_entropy(h, w, t, smoothing=SMOOTHING),
    "torch": lambda h, w, t: F.cross_entropy(F.linear(h, w), t, label_smoothing=SMOOTHING),
}


def loss_call(loss, inputs, target, backward):
    if not backward:
        return lambda: loss(*inputs, target)
    return lambda: torch.autograd.grad(loss(*inputs, target), inputs)


@pytest.mark.parametrize("impl", LOSSES)
@pytest.mark.parametrize("tokens,vocab", LOSS_CASES, ids=str)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_label_smoothed_cross_entropy(benchmark, impl, tokens, vocab, backward, dtype):
    logits = torch.randn(
        tokens, vocab, device=DEVICE, dtype=getattr(torch, dtype), requires_grad=backward
    )
    mode = "fwd+bwd" if backward else "fwd"
    measure(
        benchmark,
        loss_call(LOSSES[impl], (logits,), targets(tokens, vocab), backward),
        group=f"label_smoothed_cross_entropy {mode} {dtype} N={tokens} V={vocab}",
        bytes_moved=logits.numel() * logits.element_size() * (2 if backward else 1),
        impl=impl,
        baseline="torch",
    )


@pytest.mark.parametrize("impl", PROJECTIONS)
@pytest.mark.parametrize("tokens,d_model,vocab", PROJECTION_CASES, ids=str)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy(benchmark, impl, tokens, d_model, vocab, backward, dtype):
    def tensor(*shape, scale=1.0):
        x = torch.randn(*shape, device=DEVICE) * scale
        return x.to(getattr(torch, dtype)).requires_grad_(backward)

    hidden, weight = tensor(tokens, d_model), tensor(vocab, d_model, scale=d_model**-0.5)
    mode = "fwd+bwd" if backward else "fwd"
    measure(
        benchmark,
        loss_call(PROJECTIONS[impl], (hidden, weight), targets(tokens, vocab), backward),
        group=f"linear_cross_entropy {mode} {dtype} N={tokens} E={d_model} V={vocab}",
        flop=2 * tokens * d_model * vocab * (3 if backward else 1),
        min_rounds=3,
        impl=impl,
        baseline="torch",
    )
