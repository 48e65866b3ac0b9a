"""Sampling over top-k's candidates alone: ``generate``'s survivors in fewer kernels.

``generate`` samples with top-k and top-p by masking the whole vocabulary twice: top-k finds
the k-th score and removes every score below it; top-p sorts the whole vocabulary, takes the
softmax and its running sum, and removes the tokens whose running sum stays at or below
``1 - top_p``. grape's draw then cumulated the whole vocabulary again (``decoding.sample``).
In a graphed step those are about 60 small kernels a token, 175 us on an H100 for a vocabulary
of 32,000 (``benchmarks/sampling_ways.py``), where greedy decoding takes one argmax.

:class:`CandidateSampler` keeps ``generate``'s survivors and does less: ``torch.topk`` takes
``k + SPARE`` candidates; those below the k-th score go. For top-p, the vocabulary-wide row
``generate`` sorts is known without sorting it: the removed tokens' -inf, then the candidates
in ascending order; its softmax and running sum run over that row (the same values in the same
places as ``generate``'s, so the same kernels give the same bits), and each candidate reads the
sum at its place in the sort. Tied scores take ``generate``'s order there on a GPU, ascending
index (PyTorch sorts a row of more than 128 with radix sorts, which are stable; a GPU test
holds the survivors to ``generate``'s with ties across the cut, at 4,000 and 32,000 tokens).
On the CPU, whose sort is not stable, ``generate`` itself may keep another of equal scores.
The draw is the inverse transform of one uniform number over the survivors, as
``decoding.sample``'s, in the candidates' order.

What it cannot see: tokens tied with the k-th score beyond the candidates, which ``generate``
keeps. Where the last candidate ties with the k-th score there may be such tokens, and
:meth:`CandidateSampler.candidates` says so per row; the decoder keeps that in a flag it reads
with the generation's one read-back, and ``grape.generate`` (and the host loop) then make the
generation again with ``generate``'s warpers over the whole vocabulary, from the same seed
(:class:`CandidatesOverflowed`). It takes more than ``SPARE`` tokens of exactly the k-th score.

Used where nothing else needs the processed scores (no ``output_scores``) and sampling has
temperature, top-k (at most ``MOST_CANDIDATES - SPARE``) and top-p alone
(``Options.samples_candidates``).
"""

from __future__ import annotations

import torch

from grape.torch.warpers import DeviceTemperature, DeviceTopP

__all__ = ["MOST_CANDIDATES", "SPARE", "CandidateSampler", "CandidatesOverflowed"]

# Candidates beyond top-k's k: room for tokens tied with the k-th score.
SPARE = 64
# The most candidates taken (a larger top-k samples over the whole vocabulary): their places
# come from comparing every pair, (rows, candidates, candidates) booleans in the graph's pool.
MOST_CANDIDATES = 320


class CandidatesOverflowed(Exception):
    """A generation sampled where more tokens tied with the k-th score than the candidates
    held: its tokens are not what ``generate``'s warpers allow, and it must be made again with
    them. ``seed`` is the seed it drew with."""

    def __init__(self, seed: int | None) -> None:
        super().__init__("more tokens tied with top-k's k-th score than the sampler's "
                         "candidates held")
        self.seed = seed


class CandidateSampler:
    """Temperature, top-k and top-p as ``generate`` applies them, then one draw, over top-k's
    candidates (see the module). ``temperature`` and ``top_p`` are the decoder's device
    warpers (their values set per call); ``top_p`` None: not applied."""

    def __init__(self, temperature: DeviceTemperature, top_k: int,
                 top_p: DeviceTopP | None) -> None:
        if top_k < 1:
            raise ValueError(f"expected top_k of at least 1, found {top_k}")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self._row: torch.Tensor | None = None  # top-p's sorted row; its -inf stay

    def candidates(self, scores: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values, index, kept, overflowed) for (rows, vocabulary) ``scores`` (processed, before
        the temperature): the candidates' scores after the temperature, descending, -inf where
        top-k removes them; their token ids; which survive top-k and top-p; and, per row,
        whether tokens tied with the k-th score may lie beyond the candidates."""
        scores = self.temperature(None, scores)
        vocab = scores.shape[-1]
        k = min(self.top_k, vocab)  # (as TopKLogitsWarper)
        width = min(vocab, k + SPARE)
        values, index = torch.topk(scores, width)
        kth = values[:, k - 1:k]
        # (candidates as many as the vocabulary miss nothing)
        overflowed = (((values[:, -1:] >= kth) & (kth > -torch.inf)).squeeze(1) if width < vocab
                      else torch.zeros(values.shape[0], dtype=torch.bool, device=values.device))
        values = values.masked_fill(values < kth, -torch.inf)
        if self.top_p is None:
            return values, index, values > -torch.inf, overflowed
        rows = scores.shape[0]
        if self._row is None or self._row.shape != (rows, vocab) \
                or self._row.device != scores.device:
            self._row = torch.full((rows, vocab), -torch.inf, device=scores.device)
        # generate's sorted row: every removed token's -inf, then these ascending.
        self._row[:, vocab - width:] = values.flip(1)
        running = self._row.softmax(dim=-1).cumsum(dim=-1)[:, vocab - width:].flip(1)
        # Each candidate's place from the top in the stable sort's order: the candidates
        # above it, and those tied with it of a higher index (they come after it ascending).
        above = values[:, None, :] > values[:, :, None]
        tied = (values[:, None, :] == values[:, :, None]) & (index[:, None, :] > index[:, :, None])
        place = (above | tied).sum(dim=-1)
        # (generate removes where the sum is <= 1 - top_p, and keeps its last place)
        # (a candidate top-k removed sums to 0 there, at or below 1 - top_p: removed again)
        kept = ~(running.gather(1, place) <= self.top_p.threshold) | (place == 0)
        return values, index, kept, overflowed

    def draw(self, scores: torch.Tensor, uniform: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token per row, overflowed per row) for ``scores`` and one uniform number in [0, 1)
        per row, (rows, 1): the first survivor, in the candidates' order, whose cumulative
        probability exceeds it."""
        values, index, kept, overflowed = self.candidates(scores)
        # Weights relative to the highest score (a survivor, or tied with one), cumulated in
        # float32: at most k + SPARE of them, where the vocabulary-wide draw needs float64.
        cdf = (torch.where(kept, values, -torch.inf) - values[:, :1]).exp_().cumsum_(dim=-1)
        at = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)
        token = index.gather(1, at.clamp_(max=index.shape[-1] - 1)).squeeze(1)
        return token, overflowed
