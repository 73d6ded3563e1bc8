"""One training step (forward, fused loss, backward, Adam) of fastattn's Transformer against
torch.nn.Transformer of the same shape on the same batches, in fp32 and in mixed precision
(autocast to bf16, or fp16 with loss scaling where the GPU lacks bf16).

The batch is the paper's per GPU (step_cost.PAPER_BATCH: 3125 source + 3125 target tokens).
Seconds per step of `base` and `big` stand beside the paper's targets of 0.4 s and 1.0 s on
P100-class GPUs; on a CPU only the CPU is measured (big is left to GPUs: ~3.4x base's FLOP) and
those targets are not. MFU = model FLOP of the step (step_cost.model_flop) / time / the device's
peak for the precision (on a CPU an estimate, see common.cpu_peak_flop_per_s).

torch.nn.Transformer has the same layers, widths, dropout, tied embeddings and output vocabulary;
it adds a final LayerNorm after each stack (nn.Transformer always does) and computes the full
logits before F.cross_entropy with the same label smoothing.

`multi30k` is the model the default run trains: its softmax ranges over 5,455 of the 8,000 pieces
(--output-vocab target); `multi30k-all-outputs` is the same model over all 8,000, the preset as
it is, measured beside it for the saving.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import (
    DEVICE,
    QUICK,
    device_peak_flop_per_s,
    dtype_name,
    low_precision,
    low_precision_has_hardware,
    measure,
)
from benchmarks.step_cost import (
    PAPER_STEP_SECONDS,
    SENTENCES,
    SRC_LEN,
    TGT_LEN,
    config_shape,
    model_flop,
)
from fastattn.model import PRESETS, Transformer, TransformerConfig, sinusoids

# The default run's output vocabulary: the 5,451 pieces of Multi30k's truecased German training
# text and the 4 special ones (`python -m fastattn.train` logs the count).
MULTI30K_DE_PIECES = 5455
CONFIGS = {
    "tiny": PRESETS["tiny"],
    "multi30k": replace(PRESETS["multi30k"], output_vocab_size=MULTI30K_DE_PIECES),
    "multi30k-all-outputs": PRESETS["multi30k"],
    "base": PRESETS["base"],
    "big": PRESETS["big"],
}
if QUICK:
    PRESET_NAMES, BATCH = ["tiny"], (4, 7, 9)
elif DEVICE.type == "cuda":
    PRESET_NAMES, BATCH = ["multi30k", "multi30k-all-outputs", "base", "big"], (
        SENTENCES, SRC_LEN, TGT_LEN)
else:
    PRESET_NAMES, BATCH = ["multi30k", "multi30k-all-outputs", "base"], (
        SENTENCES, SRC_LEN, TGT_LEN)


class TorchTransformer(nn.Module):
    """The same model on torch.nn.Transformer, with the loss on materialised logits."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.register_buffer("sinusoids", sinusoids(cfg.max_len, cfg.d_model), persistent=False)
        self.transformer = nn.Transformer(
            cfg.d_model,
            cfg.heads,
            cfg.encoder_layers,
            cfg.decoder_layers,
            cfg.d_ff,
            cfg.dropout,
            batch_first=True,
        )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) * math.sqrt(self.cfg.d_model)
        return F.dropout(x + self.sinusoids[: tokens.shape[1]], self.cfg.dropout, self.training)

    def loss(self, src, tgt_in, tgt_out):
        padding = src == self.cfg.pad_id
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1], device=DEVICE)
        hidden = self.transformer(
            self.embed(src),
            self.embed(tgt_in),
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=padding,
            memory_key_padding_mask=padding,
        )
        logits = F.linear(hidden, self.embedding.weight[: self.cfg.output_size])
        return F.cross_entropy(
            logits.flatten(0, 1),
            tgt_out.flatten(),
            ignore_index=self.cfg.pad_id,
            label_smoothing=self.cfg.label_smoothing,
        )


MODELS = {"fastattn": Transformer, "torch.nn.Transformer": TorchTransformer}


def batch_for(cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BATCH's (source, decoder input, decoder target) of random ids for cfg, on DEVICE."""
    sentences, src_len, tgt_len = BATCH
    generator = torch.Generator().manual_seed(0)
    src, tgt = (
        torch.randint(1, vocab, (sentences, n), generator=generator).to(DEVICE)
        for vocab, n in ((cfg.vocab_size, src_len), (cfg.output_size, tgt_len + 1))
    )  # ids from 1: 0 is padding
    return src, tgt[:, :-1], tgt[:, 1:]


def training_step(model: nn.Module, batch, precision: str):
    """A closure running one step with Adam (the paper's betas and epsilon)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9,
                                 fused=True)  # as fastattn.train's
    dtype = low_precision() if precision == "mixed" else None
    scaler = torch.amp.GradScaler(DEVICE.type, enabled=dtype == torch.float16)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=dtype, enabled=dtype is not None):
            loss = model.loss(*batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return step


@pytest.mark.parametrize("impl", MODELS)
@pytest.mark.parametrize("precision", ["fp32", "mixed"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_training_step(benchmark, preset, precision, impl):
    if precision == "mixed" and not low_precision_has_hardware():
        pytest.skip("this CPU has no bf16 instructions: bf16 matmuls take a generic path (a "
                    "multi30k step 20x slower than fp32), so fastattn.train uses fp32 here")
    cfg = CONFIGS[preset]
    sentences, src_len, tgt_len = BATCH
    batch = batch_for(cfg)
    torch.manual_seed(0)
    model = MODELS[impl](cfg).to(DEVICE).train()
    dtype = torch.float32 if precision == "fp32" else low_precision()
    tokens = sentences * (src_len + tgt_len)
    flop = model_flop(config_shape(cfg, sentences, src_len, tgt_len))
    info = {"preset": preset, "precision": f"{precision} ({dtype_name(dtype)})", "tokens": tokens}
    if impl == "fastattn" and preset in PAPER_STEP_SECONDS:
        info["gpu_target_s"] = PAPER_STEP_SECONDS[preset]
    measure(
        benchmark,
        training_step(model, batch, precision),
        group=f"train_step {preset} {precision} {sentences}x({src_len}+{tgt_len}) tokens",
        flop=flop,
        min_rounds=3,
        impl=impl,
        baseline="torch.nn.Transformer",
        **info,
    )
    if benchmark.stats is not None:
        median = benchmark.stats.stats.median
        benchmark.extra_info["tokens_per_s"] = tokens / median
        peak = device_peak_flop_per_s(dtype)
        if peak is not None:
            benchmark.extra_info["mfu"] = flop / median / peak[0]
