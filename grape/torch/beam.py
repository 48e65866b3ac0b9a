"""Beam search as a fixed-shape step: ``generate``'s algorithm, with its length on the device.

Hugging Face's beam search (``GenerationMixin._beam_search``, the vectorised form of 2025) keeps
static-shaped running and finished beams; its only host-side state is the current length, a
Python integer that indexes the sequences and enters the length penalty. Here that length is
the device count of tokens made, so one captured step serves every iteration of a device loop,
and the arithmetic is ``generate``'s operation for operation (the same scores, so the same
tokens). The cache is reordered by beam in place (``generate``'s ``reorder_cache`` makes new
tensors, which a captured step could not follow), its tensors stacked after the first prompt
so that the reorder is one gather (``grape.torch.rows``). An encoder-decoder model's
cross-attention cache is not reordered: every beam of a prompt holds the same source, so a
reorder, which moves rows among a prompt's beams, would leave it as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.utils import (
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
)

from grape.torch.decoding import Decoder
from grape.torch.options import Options
from grape.torch.rows import RowReorder, state_tensors

__all__ = ["BeamDecoder"]


def _gather(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``tensor[b, indices[b, k], ...]``: generate's ``_gather_beams``, as a ``gather`` of the
    same elements (``take_along_dim``, generate's, first wraps negative indices around, one
    kernel more per call, nine a token; these are never negative)."""
    while indices.ndim < tensor.ndim:
        indices = indices.unsqueeze(-1)
    return torch.gather(tensor, 1, indices.expand(*indices.shape[:2], *tensor.shape[2:]))


def _penalised(scores: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """``scores + flags.to(float32) * -1e9``, generate's way of ruling candidates out, in one
    kernel rather than three: the product is exact (0 or -1e9), so adding it scaled within the
    addition rounds as the separate product and sum do."""
    return torch.add(scores, flags, alpha=-1.0e9)


class BeamDecoder(Decoder):
    """``num_beams`` beams per prompt; rows are batch x beams, beams of a prompt adjacent."""

    records_compiled = True
    records_divide = True  # (the length penalty)

    def __init__(self, model: torch.nn.Module, batch: int, prompt_len: int,
                 options: Options, step_model: Any = None, exact: bool = False) -> None:
        beams = options.num_beams
        super().__init__(model, batch * beams, prompt_len, options, step_model, exact)
        device = self.mask.device
        self.batch, self.beams = batch, beams
        self.vocab = model.config.get_text_config().vocab_size
        new = options.room  # per-token state's length (options.max_new_tokens, or more)
        n_eos = len(options.eos)
        self.keep = max(2, 1 + n_eos) * beams  # candidates kept per step, as generate keeps
        self.top_beams = torch.cat([torch.ones(beams, dtype=torch.bool),
                                    torch.zeros(self.keep - beams, dtype=torch.bool)]).to(device)
        # generate's fill value for unwritten tokens: ``pad or eos[0]`` if there is an EOS.
        pad = options.config.pad_token_id
        self.fill = ((pad if pad else options.eos[0]) if options.eos else -1)
        shape = (batch, beams)
        self.running_tokens = torch.empty((*shape, new), dtype=torch.long, device=device)
        self.tokens = torch.empty_like(self.running_tokens)  # the finished beams'
        self.running_scores = torch.empty(shape, dtype=torch.float32, device=device)
        self.scores = torch.empty_like(self.running_scores)
        self.finished = torch.empty(shape, dtype=torch.bool, device=device)
        self.improvable = torch.empty((batch, 1), dtype=torch.bool, device=device)
        self.running_origins = torch.empty((*shape, new), dtype=torch.int32, device=device)
        self.origins = torch.empty_like(self.running_origins)
        self.batch_offset = (torch.arange(batch, device=device) * beams).view(-1, 1)
        # generate's length penalty divisor, (tokens made) ** length_penalty, per count: float64
        # powers rounded to float32, as Python's float power is before the division.
        lengths = torch.arange(new + 1, dtype=torch.float64, device=device)
        self.penalty = (lengths ** options.length_penalty).to(torch.float32)
        hypothetical = torch.full_like(lengths, options.max_new_tokens) if (
            options.early_stopping == "never" and options.length_penalty > 0) else lengths
        self.best_penalty = (hypothetical ** options.length_penalty).to(torch.float32)
        self.reorder: RowReorder | None = None  # once the cache's tensors exist (prefill)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                decoder_ids: torch.Tensor | None = None,
                decoder_mask: torch.Tensor | None = None,
                embeds: torch.Tensor | None = None,
                model_inputs: dict[str, torch.Tensor] | None = None) -> int:
        copied = super().prefill(input_ids, attention_mask, decoder_ids, decoder_mask, embeds,
                                 model_inputs)
        if self.reorder is None and (self.mask.device.type != "cuda"
                                     or not torch.cuda.is_current_stream_capturing()):
            # The prompt allocated the cache's tensors; nothing captured reads them yet.
            self.reorder = RowReorder(self.layers, self.rows)
        return copied

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every prompt once per beam, adjacent, as generate expands it."""
        return t.repeat_interleave(self.beams, dim=0)

    def _reset(self) -> None:
        self.running_tokens.fill_(self.fill)
        self.tokens.fill_(self.fill)
        self.running_scores.zero_()
        self.running_scores[:, 1:] = -1e9
        self.scores.fill_(-1e9)
        self.finished.zero_()
        self.improvable.fill_(True)
        self.running_origins.fill_(-1)
        self.origins.fill_(-1)

    def _emit(self, logits: torch.Tensor) -> None:
        self._recorded(self._record(self._choose(logits)))

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top continuations over every beam (generate's _get_top_k_continuations): their
        scores and their indices into (beam, token)."""
        batch, beams, vocab = self.batch, self.beams, self.vocab
        log_probs = self._renormalized(
            self._process(torch.nn.functional.log_softmax(logits, dim=-1)))
        self._keep("scores", log_probs)  # generate's: processed, before the beams' own scores
        self._keep("logits", logits)
        log_probs = log_probs.view(batch, beams, vocab) + self.running_scores[:, :, None]
        top_scores, top_indices = torch.topk(log_probs.reshape(batch, beams * vocab),
                                             k=self.keep)
        return top_scores, top_indices

    def _record(self, top: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """From the top continuations: the beams that run on, the finished hypotheses kept,
        whether the search goes on; returns each beam's origin, for :meth:`_recorded`."""
        batch, beams, vocab, t = self.batch, self.beams, self.vocab, self.count
        top_scores, top_indices = top
        from_beam = top_indices // vocab
        top_origins = _gather(self.running_origins, from_beam)
        top_tokens = _gather(self.running_tokens, from_beam)
        ids = top_indices % vocab
        top_tokens.index_copy_(2, t, ids.unsqueeze(-1))
        top_origins.index_copy_(2, t, (from_beam + self.batch_offset).to(torch.int32)
                                .unsqueeze(-1))
        # Which continuations end: an EOS, or the last token allowed (generate's criteria).
        hits = torch.isin(ids, self.eos) if self.options.eos else torch.zeros_like(ids, dtype=bool)
        hits = hits | (t + 1 >= self.options.max_new_tokens)
        if self.stops is not None:  # each continuation's text: its beam's last tokens, and it
            n = self.stops.maximum_token_len
            before = _gather(self._tail(n - 1).view(batch, beams, n - 1), from_beam)
            text = torch.cat((before, ids.unsqueeze(-1)), dim=-1).view(-1, n)
            hits = hits | self.stops(text, None).view(batch, self.keep)
        # The best unfinished continuations run on (_get_running_beams_for_next_iteration).
        running = _penalised(top_scores, hits)
        chosen = torch.topk(running, k=beams)[1]
        self.running_tokens.copy_(_gather(top_tokens, chosen))
        self.running_scores.copy_(_gather(running, chosen))
        self.running_origins.copy_(_gather(top_origins, chosen))
        self._finish(top_tokens, top_scores, top_origins, hits)
        # Each beam's origin: the row the cache follows it from (_recorded).
        rows = self.running_origins.index_select(2, t).view(-1).to(torch.long)
        self.next_ids.copy_(self.running_tokens.index_select(2, t).view(-1, 1))
        if self.seen is not None:  # each beam's tokens are its origin's and its new one
            self.seen.copy_(self.seen.index_select(0, rows))
            self.seen.scatter_(1, self.next_ids, True)
        if self.history is not None:
            self.history.copy_(self.history.index_select(0, rows))
            self.history.index_copy_(1, t + self.head_len, self.next_ids)
        self.count.add_(1)
        self._stop_check(hits)
        return rows

    def _recorded(self, rows: torch.Tensor) -> None:
        """The cache follows the beams (in place: a captured step reads fixed addresses).
        Outside the compiled bookkeeping: a bandwidth-bound gather of the whole cache, which
        ``RowReorder`` does in the form measured fastest (``benchmarks/row_reorder.py``)."""
        if self.reorder is not None:
            self.reorder(rows)
        else:  # the first prompt's token: the cache is not stacked yet
            for layer in self.layers:
                for state in state_tensors(layer):
                    state.copy_(state.index_select(0, rows))

    def _finish(self, top_tokens: torch.Tensor, top_scores: torch.Tensor,
                top_origins: torch.Tensor, hits: torch.Tensor) -> None:
        """Keep the best finished hypotheses (generate's _update_finished_beams)."""
        just_finished = hits & self.top_beams[None, :]
        scores = top_scores / self.penalty.index_select(0, self.count + 1)
        full = torch.all(self.finished, dim=-1, keepdim=True) & (
            self.options.early_stopping is True)
        scores = _penalised(scores, full)
        scores = _penalised(scores, ~self.improvable)
        scores = _penalised(scores, ~just_finished)
        merged_scores = torch.cat((self.scores, scores), dim=1)
        best = torch.topk(merged_scores, k=self.beams)[1]
        self.tokens.copy_(_gather(torch.cat((self.tokens, top_tokens), dim=1), best))
        self.scores.copy_(_gather(merged_scores, best))
        self.origins.copy_(_gather(torch.cat((self.origins, top_origins), dim=1), best))
        self.finished.copy_(_gather(torch.cat((self.finished, just_finished), dim=1), best))

    def _stop_check(self, hits: torch.Tensor) -> None:
        """generate's _check_early_stop_heuristic and _beam_search_has_unfinished_sequences,
        after the length moved on."""
        best_running = self.running_scores[:, :1] / self.best_penalty.index_select(0, self.count)
        worst_finished = torch.where(self.finished,
                                     torch.min(self.scores, dim=1, keepdim=True)[0], -1.0e9)
        self.improvable.logical_and_(torch.any(best_running > worst_finished, dim=-1,
                                               keepdim=True))
        open_beam = ~(torch.all(self.finished) & (self.options.early_stopping is True))
        torch.logical_and(torch.any(self.improvable) & open_beam, ~torch.all(hits),
                          out=self.running)

    def result(self, input_ids: torch.Tensor, decoder_ids: torch.Tensor | None = None
               ) -> torch.Tensor | GenerateBeamDecoderOnlyOutput | GenerateBeamEncoderDecoderOutput:
        # The best beams (num_return_sequences of each prompt's, best first, as generate's
        # finished beams are sorted), their length and the steps run, in one read-back.
        n = self.options.num_return
        origins = self.origins[:, :n].flatten(0, 1)
        made_t = ((origins + 1).bool()).sum(dim=1).max()
        made, steps = torch.stack((made_t, self.count[0])).tolist()
        self._check_lengths()
        sequences = torch.cat([self.head(input_ids, decoder_ids).repeat_interleave(n, dim=0),
                               self.tokens[:, :n, :made].flatten(0, 1)], dim=1)
        if not self.options.return_dict:
            return sequences
        # As generate returns it: the returned beams' scores (kept with output_scores), every
        # step's scores and logits for every beam, the returned beams' beam indices;
        # past_key_values None (grape's cache is the next call's).
        kept = self._kept(steps)
        output = (GenerateBeamEncoderDecoderOutput if self.seq2seq
                  else GenerateBeamDecoderOnlyOutput)
        return output(
            sequences=sequences,
            sequences_scores=(self.scores[:, :n].flatten().clone() if "scores" in self.kept
                              else None),
            scores=kept.get("scores"), logits=kept.get("logits"),
            beam_indices=origins[:, :made].clone(), past_key_values=None)
