"""Beam search and greedy search over any step function, with finished sentences leaving the batch.

The decoder is a `step_fn(tokens, reorder) -> logprobs`: `tokens` (N, t) holds the live prefixes,
BOS first; `reorder` is None on the first call and afterwards a LongTensor (N,) giving for each
row the row of the previous call it continues (apply it to any cache before the step). The first
call has one row per sentence; later calls have `beam_size` rows per unfinished sentence.

Each step of `beam_search` (Wu et al. 2016; fairseq's variant):
  candidates    c = score(prefix) + log p(token | prefix) over beam × vocabulary, and at the last
                position allowed by max_len only EOS may follow;
  selection     the top 2·beam candidates per sentence, ordered by c, ties by the lower
                beam·V + token index, so that every implementation picks the same ones;
  finishing     EOS candidates among the top beam become hypotheses scored c / lp(|Y|), with
                "gnmt" lp = ((5 + |Y|) / 6)^α (the paper's) or "pow" lp = |Y|^α (fairseq,
                CTranslate2), |Y| counting the EOS; at most beam_size per sentence;
  back-filling  the first beam non-EOS candidates are the next live prefixes;
  stopping      a sentence is done once beam_size hypotheses finished, at its max_len, or when
                the bound below proves no live prefix can enter its nbest. Done sentences leave
                the batch, and the next `reorder` reflects that compaction.
The bound: log-probabilities are ≤ 0, so a live prefix scoring c can finish at best with
c / max(lp(t + 1), lp(max_len)) (lp is monotonic in |Y|); if the nbest-th finished score is at
least that for every live prefix, continuing would change nothing that is returned.

`impl="native"` runs one step of this bookkeeping as a single call into the extension fastattn._C
(C++ on CPU tensors, CUDA kernels on CUDA tensors), `impl="python"` is the PyTorch reference
below; both return identical tokens and scores.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from fastattn._native import native

StepFn = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
LengthPenalty = Literal["gnmt", "pow"]


@dataclass
class Hypothesis:
    tokens: list[int]
    """Generated ids without BOS, ending with EOS."""
    score: float
    """Summed log-probability divided by the length penalty."""


def length_penalty_table(max_len: int, alpha: float, kind: LengthPenalty) -> list[float]:
    """lp(|Y|) for |Y| = 0 .. max_len: "gnmt" ((5 + |Y|) / 6)^α, "pow" |Y|^α."""
    if kind == "gnmt":
        return [math.pow((5 + n) / 6, alpha) for n in range(max_len + 1)]
    if kind == "pow":
        return [math.pow(n, alpha) if n else 1.0 for n in range(max_len + 1)]
    raise ValueError(f"length_penalty must be 'gnmt' or 'pow', got {kind!r}")


def check_special_ids(bos_id: int, eos_id: int, vocab_size: int, output_size: int) -> None:
    """ValueError naming bos_id or eos_id where a model has no such token: BOS goes into the
    decoder (an id below vocab_size), EOS comes out of it (below output_size, the output
    vocabulary's size)."""
    if not 0 <= bos_id < vocab_size:
        raise ValueError(f"bos_id {bos_id} is outside the vocabulary of {vocab_size} "
                         f"(ids 0 to {vocab_size - 1})")
    if not 0 <= eos_id < output_size:
        raise ValueError(f"eos_id {eos_id} is outside the output vocabulary of {output_size} "
                         f"(ids 0 to {output_size - 1})")


def beam_search(
    step_fn: StepFn,
    batch_size: int,
    *,
    beam_size: int = 4,
    bos_id: int,
    eos_id: int,
    max_len: int | torch.Tensor,
    alpha: float = 0.6,
    length_penalty: LengthPenalty = "gnmt",
    nbest: int = 1,
    impl: Literal["auto", "native", "python"] = "auto",
    device: torch.device | str | None = None,
) -> list[list[Hypothesis]]:
    """For each of `batch_size` sentences, its `nbest` best hypotheses, best first.

    max_len: an int or a per-sentence tensor (batch_size,): the most tokens a hypothesis may have,
    its EOS included. device: where tokens and the search state live (default: CPU, or the device
    of a max_len tensor). A sentence can return fewer than nbest hypotheses only if its step_fn
    gives -inf to all but a few continuations.
    """
    setup = BeamSearchSetup.create(batch_size, beam_size, nbest, max_len, alpha, length_penalty,
                                   device)
    device = setup.limits.device
    step = _pick_step(impl, device)
    tokens = torch.full((batch_size, 1), bos_id, dtype=torch.long, device=device)
    scores = torch.zeros(batch_size, device=device)
    sentences = torch.arange(batch_size, device=device)
    reorder = None
    while sentences.numel():
        logprobs = _call(step_fn, tokens, reorder, eos_id)
        tokens, scores, reorder, sentences = step(
            logprobs, tokens, scores, sentences, setup.limits, setup.penalty, *setup.finished,
            eos_id, nbest,
        )  # fmt: skip
    return setup.best(nbest)


@dataclass
class BeamSearchSetup:
    """A batch's search state besides the live prefixes: the per-sentence limits (B,), the
    length-penalty table (limits.max() + 1,) float64, and the finished hypotheses
    (tokens (B, beam, L), scores (B, beam), lengths (B, beam), count (B,)), which the search
    steps fill in place. Shared by beam_search and Transformer.beam_search's native loop."""

    limits: torch.Tensor
    penalty: torch.Tensor
    finished: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

    @classmethod
    def create(cls, batch_size: int, beam_size: int, nbest: int, max_len: int | torch.Tensor,
               alpha: float, length_penalty: LengthPenalty,
               device: torch.device | str | None = None) -> BeamSearchSetup:
        if beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {beam_size}")
        if not 1 <= nbest <= beam_size:
            raise ValueError(f"nbest must be between 1 and beam_size={beam_size}, got {nbest}")
        limits, device = _max_len_tensor(max_len, batch_size, device)
        longest = int(limits.max()) if batch_size else 0
        penalty = torch.tensor(length_penalty_table(longest, alpha, length_penalty),
                               dtype=torch.float64, device=device)
        finished = (
            torch.zeros(batch_size, beam_size, longest, dtype=torch.long, device=device),
            torch.zeros(batch_size, beam_size, device=device),
            torch.zeros(batch_size, beam_size, dtype=torch.long, device=device),
            torch.zeros(batch_size, dtype=torch.long, device=device),
        )
        return cls(limits, penalty, finished)

    def best(self, nbest: int) -> list[list[Hypothesis]]:
        """Each sentence's nbest hypotheses, best first, ties in the order they finished."""
        tokens, scores, lengths, counts = (x.tolist() for x in self.finished)
        results = []
        for b, count in enumerate(counts):
            order = sorted(range(count), key=lambda j: -scores[b][j])[:nbest]
            results.append([Hypothesis(tokens[b][j][: lengths[b][j]], scores[b][j])
                            for j in order])
        return results


def greedy_search(
    step_fn: StepFn,
    batch_size: int,
    *,
    bos_id: int,
    eos_id: int,
    max_len: int | torch.Tensor,
    alpha: float = 0.6,
    length_penalty: LengthPenalty = "gnmt",
    device: torch.device | str | None = None,
) -> list[Hypothesis]:
    """The most probable next token at every step: one hypothesis per sentence, scored like
    beam_search's (so beam_size=1 gives the same tokens and scores), or None for a sentence whose
    step_fn made every continuation -inf."""
    limits, device = _max_len_tensor(max_len, batch_size, device)
    penalty = length_penalty_table(int(limits.max()) if batch_size else 0, alpha, length_penalty)
    results: list[Hypothesis | None] = [None] * batch_size

    tokens = torch.full((batch_size, 1), bos_id, dtype=torch.long, device=device)
    scores = torch.zeros(batch_size, device=device)
    sentences = torch.arange(batch_size, device=device)
    reorder = None
    while sentences.numel():
        t = tokens.size(1)
        candidates = scores[:, None] + _call(step_fn, tokens, reorder, eos_id)
        last = limits[sentences] == t
        best = torch.where(last, eos_id, candidates.argmax(1))
        scores = candidates.gather(1, best[:, None]).squeeze(1)
        ended = (best == eos_id) | last | (scores == -math.inf)
        for i in ended.nonzero().flatten().tolist():
            if best[i] == eos_id and scores[i] > -math.inf:
                score = torch.tensor(float(scores[i]) / penalty[t], dtype=torch.float32).item()
                results[int(sentences[i])] = Hypothesis(tokens[i, 1:].tolist() + [eos_id], score)
        reorder = (~ended).nonzero().flatten()
        tokens = torch.cat([tokens[reorder], best[reorder, None]], 1)
        scores, sentences = scores[reorder], sentences[reorder]
    return results


def _max_len_tensor(
    max_len: int | torch.Tensor, batch_size: int, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.device]:
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    if isinstance(max_len, torch.Tensor):
        device = torch.device(device if device is not None else max_len.device)
        if max_len.shape != (batch_size,) or max_len.is_floating_point():
            raise ValueError(
                f"max_len must be an int or an integer tensor of shape ({batch_size},), got "
                f"{max_len.dtype} of shape {tuple(max_len.shape)}"
            )
        limits = max_len.to(device=device, dtype=torch.long)
    else:
        device = torch.device(device if device is not None else "cpu")
        limits = torch.full((batch_size,), int(max_len), dtype=torch.long, device=device)
    if batch_size and int(limits.min()) < 1:
        raise ValueError(f"max_len must be >= 1 (it counts the EOS), got {int(limits.min())}")
    return limits, device


def _call(
    step_fn: StepFn, tokens: torch.Tensor, reorder: torch.Tensor | None, eos_id: int
) -> torch.Tensor:
    logprobs = step_fn(tokens, reorder)
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2:
        raise ValueError("step_fn must return a tensor of log-probabilities of shape (N, V)")
    if logprobs.size(0) != tokens.size(0) or not 0 <= eos_id < logprobs.size(1):
        raise ValueError(
            f"step_fn returned shape {tuple(logprobs.shape)} for {tokens.size(0)} prefixes; "
            f"expected ({tokens.size(0)}, V) with eos_id={eos_id} < V"
        )
    if logprobs.size(1) < 2:
        raise ValueError("the vocabulary needs at least one token besides EOS")
    if not logprobs.is_floating_point():
        raise ValueError(f"step_fn must return float log-probabilities, got {logprobs.dtype}")
    return logprobs.float().contiguous()


def _pick_step(impl: str, device: torch.device) -> Callable[..., tuple[torch.Tensor, ...]]:
    if impl not in ("auto", "native", "python"):
        raise ValueError(f"impl must be 'auto', 'native' or 'python', got {impl!r}")
    if impl == "python":
        return beam_search_step_python
    built = native is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "fastattn::beam_search_step", "CUDA" if device.type == "cuda" else "CPU"
    )
    if built:
        return torch.ops.fastattn.beam_search_step
    if impl == "native":
        raise RuntimeError(
            f"impl='native' needs fastattn._C built with beam search for {device.type} tensors; "
            "use impl='python' or rebuild with `pip install .`"
        )
    return beam_search_step_python


def beam_search_step_python(
    logprobs: torch.Tensor,
    tokens: torch.Tensor,
    scores: torch.Tensor,
    sentences: torch.Tensor,
    max_len: torch.Tensor,
    penalty: torch.Tensor,
    finished_tokens: torch.Tensor,
    finished_scores: torch.Tensor,
    finished_lengths: torch.Tensor,
    finished_count: torch.Tensor,
    eos_id: int,
    nbest: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of beam search in PyTorch: the reference for fastattn._C's beam_search_step.

    logprobs (N, V) float32 for the N = S·k live rows of the S unfinished `sentences` (k = 1 on
    the first step, else beam), `tokens` (N, t) their prefixes and `scores` (N,) their summed
    log-probabilities; `max_len` (B,) and `penalty` (max_len.max() + 1,) float64 cover the batch.
    Appends hypotheses to finished_* (B, beam, ...) in place and returns the next
    (tokens (N', t + 1), scores (N',), reorder (N',), sentences (S',)).
    """
    if not bool((logprobs <= 0).all()):
        raise ValueError("step_fn returned NaN or positive values, not log-probabilities")
    (n, vocab), s, t = logprobs.shape, sentences.numel(), tokens.size(1)
    beam, k_in = finished_scores.size(1), n // s
    limit = max_len[sentences]
    last = limit == t
    candidates = (scores[:, None] + logprobs).view(s, k_in, vocab)
    if bool(last.any()):
        only_eos = torch.full_like(candidates, -math.inf)
        only_eos[:, :, eos_id] = candidates[:, :, eos_id]
        candidates = torch.where(last[:, None, None], only_eos, candidates)
    top, index = _top(candidates.view(s, k_in * vocab), min(2 * beam, k_in * vocab))
    first_rows = torch.arange(s, device=index.device)[:, None] * k_in
    token, rows = index % vocab, first_rows + index // vocab
    is_eos = token == eos_id

    # Finish EOS candidates among the top beam, up to beam hypotheses per sentence.
    rank = torch.arange(top.size(1), device=top.device)
    finishing = is_eos & (rank < beam) & (top > -math.inf)
    slot = finished_count[sentences][:, None] + finishing.cumsum(1) - 1
    finishing &= slot < beam
    i, j = finishing.nonzero(as_tuple=True)
    b, slot, row = sentences[i], slot[i, j], rows[i, j]
    finished_tokens[b, slot, : t - 1] = tokens[row, 1:]
    finished_tokens[b, slot, t - 1] = eos_id
    finished_scores[b, slot] = (top[i, j].double() / penalty[t]).float()
    finished_lengths[b, slot] = t
    finished_count.index_add_(0, b, torch.ones_like(b))

    # Back-fill: the first beam non-EOS candidates live on, dead (-inf) fillers if too few.
    if top.size(1) - beam < beam:
        fill = top.new_full((s, beam), -math.inf)
        top = torch.cat([top, fill], 1)
        token = torch.cat([token, torch.full_like(fill, eos_id, dtype=torch.long)], 1)
        rows = torch.cat([rows, first_rows.expand(s, beam)], 1)
        is_eos = torch.cat([is_eos, torch.zeros_like(fill, dtype=torch.bool)], 1)
    live = ~is_eos & (torch.cumsum(~is_eos, 1) <= beam)
    live_scores, live_tokens = top[live].view(s, beam), token[live].view(s, beam)
    live_rows = rows[live].view(s, beam)

    # Done: beam hypotheses, max_len reached, no live prefix, or the bound (module docstring).
    count = finished_count[sentences]
    best_live = live_scores.max(1).values
    slots = torch.arange(beam, device=count.device)
    finished = finished_scores[sentences].masked_fill(slots >= count[:, None], -math.inf)
    nth_best = finished.topk(nbest, 1).values[:, -1]
    most_penalty = torch.maximum(penalty[torch.clamp(limit, max=t + 1)], penalty[limit])
    bound = (best_live.double() / most_penalty).float()
    hopeless = (count >= nbest) & (nth_best >= bound)
    done = (count >= beam) | last | (best_live == -math.inf) | hopeless

    keep = (~done).nonzero().flatten()
    reorder = live_rows[keep].flatten()
    tokens = torch.cat([tokens[reorder], live_tokens[keep].view(-1, 1)], 1)
    return tokens, live_scores[keep].flatten(), reorder, sentences[keep]


def _top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k per row by value, ties by lower index (torch.topk leaves the order of ties open)."""
    values, index = x.topk(k, 1)
    tied_at_edge = (x >= values[:, -1:]).sum(1) > k
    if bool(tied_at_edge.any()):
        edge_values, edge_index = x[tied_at_edge].sort(dim=1, descending=True, stable=True)
        values[tied_at_edge], index[tied_at_edge] = edge_values[:, :k], edge_index[:, :k]
    index, order = index.sort(1)
    values, order = values.gather(1, order).sort(dim=1, descending=True, stable=True)
    return values, index.gather(1, order)
