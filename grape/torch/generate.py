"""Greedy generation as one fixed-shape step: the form a loop needs to run on the device.

A Hugging Face ``generate`` loop reads a value back every token (are all sequences done?), and
its cache changes shape as it grows, so it cannot be captured. ``GreedyDecoder`` keeps every
tensor the loop touches at a fixed shape and address: a ``transformers`` ``StaticCache`` sized to
prompt plus new tokens (attention runs over all of it, masked past the current length, so the
step's kernels and their arguments are the same at every length), the output tokens, the
position, the step count, which sequences are done, and whether to go on. :meth:`step` makes one
token for every sequence with GPU work alone; :attr:`running` is a GPU boolean. Run eagerly
(:func:`generate_host_loop`) it reads ``running`` back once per token, as ``generate`` does; as
the body of a device-side loop it needs no host sync at all.

Semantics follow ``generate(do_sample=False)``: a sequence that has produced ``eos_token_id``
produces ``pad_token_id`` from then on, and generation stops when every sequence is done or
``max_new_tokens`` are made.
"""

from __future__ import annotations

import torch
from transformers import StaticCache

from grape.errors import GrapeError

__all__ = ["GreedyDecoder", "generate_host_loop"]


class GreedyDecoder:
    def __init__(self, model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int,
                 eos_token_id: int | None, pad_token_id: int | None = None,
                 keep_logits: bool = False) -> None:
        if prompt.ndim != 2 or prompt.dtype != torch.long or prompt.shape[1] < 1:
            raise GrapeError(f"expected prompt token ids of shape (batch, length >= 1) and "
                             f"dtype long, found shape {tuple(prompt.shape)} and {prompt.dtype}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GrapeError(f"expected max_new_tokens of at least 1 (a loop needs a bound), "
                             f"found {max_new_tokens!r}")
        self.model = model
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        batch, length = prompt.shape
        device = prompt.device
        # No EOS: nothing ever finishes (an id no token has); pad as generate does, with EOS.
        self.eos = -1 if eos_token_id is None else eos_token_id
        self.pad = pad_token_id if pad_token_id is not None else max(self.eos, 0)
        self.cache = StaticCache(config=model.config, max_cache_len=length + max_new_tokens)
        self.tokens = torch.full((batch, max_new_tokens), self.pad, dtype=torch.long,
                                 device=device)
        self.next_ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.count = torch.zeros((1,), dtype=torch.long, device=device)  # tokens made so far
        self.done = torch.zeros((batch,), dtype=torch.bool, device=device)
        self.running = torch.zeros((), dtype=torch.bool, device=device)
        # The last token's logits, for comparing runs (one copy per step); None unless asked.
        head = model.get_output_embeddings().weight
        self.logits = (torch.zeros((batch, head.shape[0]), dtype=head.dtype, device=device)
                       if keep_logits else None)

    @torch.no_grad()
    def prefill(self) -> None:
        """Run the prompt (eagerly: its shape is the prompt's) and make the first token."""
        self.cache.reset()
        self.done.zero_()
        self.tokens.fill_(self.pad)
        length = self.prompt.shape[1]
        positions = torch.arange(length, device=self.prompt.device).expand(len(self.prompt), -1)
        logits = self.model(self.prompt, past_key_values=self.cache, position_ids=positions,
                            use_cache=True).logits[:, -1]
        self.position.fill_(length)
        self.count.zero_()
        self._emit(logits)

    @torch.no_grad()
    def step(self) -> None:
        """One token for every sequence, at fixed shapes, with no host sync."""
        logits = self.model(self.next_ids, past_key_values=self.cache,
                            position_ids=self.position, use_cache=True).logits[:, -1]
        self.position.add_(1)
        self._emit(logits)

    def _emit(self, logits: torch.Tensor) -> None:
        if self.logits is not None:
            self.logits.copy_(logits)
        token = torch.argmax(logits, dim=-1)
        token = torch.where(self.done, torch.full_like(token, self.pad), token)
        self.tokens.index_copy_(1, self.count, token.unsqueeze(1))
        self.done.logical_or_(token == self.eos)
        self.next_ids.copy_(token.unsqueeze(1))
        self.count.add_(1)
        torch.logical_and(~self.done.all(), self.count[0] < self.max_new_tokens,
                          out=self.running)

    def generated(self) -> torch.Tensor:
        """The new tokens made so far, as a copy (reads the count back: one sync).

        A copy, not a view of the decoder's buffer: the next generation (a graph replay the
        host does not see) overwrites that buffer, and a view would change under its holder.
        """
        return self.tokens[:, :int(self.count.item())].clone()


def generate_host_loop(decoder: GreedyDecoder) -> torch.Tensor:
    """Greedy generation with the host deciding each step: one sync per token."""
    decoder.prefill()
    while bool(decoder.running):
        decoder.step()
    return decoder.generated()
