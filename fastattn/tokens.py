"""Checks of the model's token-id arguments, with messages that name the argument, the bad id,
its place and the vocabulary: shapes and dtypes always, the id range where it costs no device
sync (range_checked); and the non-padding positions the loss projects (non_padding)."""

from __future__ import annotations

import torch
from torch import Tensor

# What each checked argument holds, for the messages.
_TOKEN_KINDS = {"src": "source", "tgt_in": "target input", "tokens": "decoder input"}


def non_padding(tokens: Tensor, pad_id: int, count: int | None = None) -> Tensor:
    """The flat positions of the non-padding ids of tokens (B, T), in order. Boolean indexing or
    nonzero makes a GPU's host wait to learn the output size; with the count known (train_step
    counts it on the host batch) nonzero_static needs no wait. A wrong count raises ValueError
    where checking costs no sync (range_checked); on a GPU, a count too high trips a device-side
    index check where the positions are used, one too low drops the last tokens."""
    real = tokens.reshape(-1) != pad_id
    if count is None:
        return real.nonzero().squeeze(1)
    if range_checked(tokens) and int(real.sum()) != count:
        raise ValueError(f"tokens={count}, but the targets hold {int(real.sum())} non-padding "
                         "tokens")
    return torch.nonzero_static(real, size=count).squeeze(1)


def rows(x: Tensor, positions: Tensor) -> Tensor:
    """x (B, T, ...) -> its rows (N, ...) at flat positions of the (B·T) grid."""
    return x.flatten(0, 1).index_select(0, positions)


def range_checked(tokens: Tensor) -> bool:
    """Whether the token ids are checked against the vocabulary on every call: on CPU, where
    the one min/max reduction costs no device sync (and outside torch.compile's tracing). On
    GPUs only the decoding entry points check (Decoder.start, so beam search and translation):
    a check in each training step would synchronise the device every step."""
    return tokens.device.type == "cpu" and not torch.compiler.is_compiling()


def outside(tokens: Tensor, vocab_size: int, ignore: int | None = None) -> tuple[int, str] | None:
    """(the first id outside [0, vocab_size) that is not `ignore`, where it sits: "(batch b,
    position t)" or "row n"), or None. One min/max pass; the search only after a bad one."""
    if tokens.numel() == 0:
        return None
    low, high = torch.aminmax(tokens)
    if low >= 0 and high < vocab_size:
        return None
    bad = (tokens < 0) | (tokens >= vocab_size)
    if ignore is not None:
        bad &= tokens != ignore
    where = bad.nonzero()
    if len(where) == 0:
        return None
    at = where[0].tolist()
    place = f"(batch {at[0]}, position {at[1]})" if len(at) == 2 else f"row {at[0]}"
    return int(tokens[tuple(at)]), place


def check_token_range(name: str, tokens: Tensor, vocab_size: int) -> None:
    """ValueError naming the first token id outside the vocabulary, its place and the size."""
    bad = outside(tokens, vocab_size)
    if bad is not None:
        raise ValueError(f"{_TOKEN_KINDS.get(name, name)} token id {bad[0]} at {bad[1]} is "
                         f"outside the vocabulary of {vocab_size} (ids 0 to {vocab_size - 1})")


def check_tokens(name: str, tokens: Tensor, vocab_size: int) -> None:
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(f"{name} must be a (batch, length) LongTensor of token ids, got "
                         f"{tuple(tokens.shape)} {tokens.dtype}")
    if tokens.shape[1] == 0:
        raise ValueError(f"{name} is empty: sequences need at least one token")
    if range_checked(tokens):
        check_token_range(name, tokens, vocab_size)


def check_loss_args(tgt_in: Tensor, tgt_out: Tensor, reduction: str, output_size: int,
                    pad_id: int) -> None:
    if tgt_out.shape != tgt_in.shape:
        raise ValueError(f"tgt_out {tuple(tgt_out.shape)} and tgt_in {tuple(tgt_in.shape)} "
                         "must have the same shape")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if range_checked(tgt_out):  # the loss op checks too, but cannot name (batch, position)
        bad = outside(tgt_out, output_size, ignore=pad_id)
        if bad is not None:
            raise ValueError(
                f"target {bad[0]} is out of range for {output_size} classes (the output "
                f"vocabulary), at {bad[1]} of tgt_out")
