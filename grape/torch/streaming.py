"""A graphed generation's tokens handed to a ``generate`` streamer as they are made.

``generate(..., streamer=s)`` calls ``s.put`` with the sequences' head (the prompt, or an
encoder-decoder's decoder prompt, one row per sequence) before the first step, then with each
step's tokens as a (rows,) tensor on the host, and ``s.end()`` at the end: a read-back per token,
which a device loop exists to avoid. grape's loop stays one launch with no host involvement,
and the host *follows* it instead (:meth:`TokenFeed.follow`): from a side stream it copies the
decoder's token count and tokens into pinned memory while the launch runs, and hands the
streamer the tokens the count covers. In the loop's stream order a token is written before the
count that covers it, and the side stream reads the count before the tokens, so every token
handed on is final. The side stream waits only for the count's reset, enqueued just before the
launch (so a count left by the previous generation is never read), and overlaps the loop's
kernels after that; the loop's stream is never synchronised by the following, so a generation
still costs one host sync, where its result is read. The last copies are made once the launch
has ended, so every token it made is handed on before the call returns.

A loop whose result turns out unusable after the launch (exact lengths over a mask that is not
left-padded, ``grape.torch.exact``) hands on nothing: its prompt check is followed too, and the
loop that runs instead streams the tokens.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["TokenFeed"]

# Between two copies while following a launch: short against a step (0.1 to a few ms on the
# H200), long against the copies themselves (a few microseconds).
POLL_S = 0.0005


class TokenFeed:
    """One call's streamer, fed from one generation's decoder (a ``TokenDecoder``: its
    ``tokens`` (rows, room) and ``count`` (1,) on the device)."""

    def __init__(self, streamer: Any) -> None:
        self.streamer = streamer
        self.head_sent = False
        self.sent = 0  # tokens handed on
        self.while_running = 0  # of those, handed on before the launch had ended

    def _head(self, head: torch.Tensor) -> None:
        if not self.head_sent:
            self.streamer.put(head.cpu())
            self.head_sent = True

    def deliver(self, head: torch.Tensor, tokens: torch.Tensor, made: int) -> None:
        """Hands on tokens ``sent`` to ``made`` of ``tokens`` (rows, at least ``made``), on the
        host, the head first."""
        self._head(head)
        for i in range(self.sent, made):
            self.streamer.put(tokens[:, i].clone())
        self.sent = max(self.sent, made)

    def follow(self, decoder: Any, head: torch.Tensor, launch: Any,
               prompt_inside: bool = True) -> None:
        """``launch()``, and the host hands the streamer each token as the launch makes it,
        until the launch has ended (see the module). ``head``: the sequences' head, where it
        lies (read from the side stream too). ``prompt_inside``: the launch runs the prompt
        (which zeroes the count); else the prompt ran before it, and its count stands."""
        device = decoder.count.device
        side = _side_stream(device)
        host_count = torch.zeros(1, dtype=torch.long, pin_memory=True)
        host_tokens = torch.empty(decoder.tokens.shape, dtype=decoder.tokens.dtype,
                                  pin_memory=True)
        lengths = getattr(decoder, "lengths", None)
        host_ok = torch.ones((), dtype=torch.bool, pin_memory=True)
        if prompt_inside:  # (the launch's prompt zeroes it again, in its own place)
            decoder.count.zero_()
        reset = torch.cuda.Event()
        reset.record()
        launch()
        ended = torch.cuda.Event()
        ended.record()
        side.wait_event(reset)
        with torch.cuda.stream(side):
            head = head.to("cpu", non_blocking=True)
        while True:
            finished = ended.query()  # before the copies: they then see everything made
            with torch.cuda.stream(side):
                host_count.copy_(decoder.count, non_blocking=True)
                if lengths is not None:  # the prompt's check, made before any token
                    host_ok.copy_(lengths.ok, non_blocking=True)
                host_tokens.copy_(decoder.tokens, non_blocking=True)
                copied = side.record_event()
            copied.synchronize()
            made = int(host_count[0])
            if made and bool(host_ok):
                before = self.sent
                self.deliver(head, host_tokens, made)
                if not finished:
                    self.while_running += self.sent - before
            if finished:
                return
            time.sleep(POLL_S)

    def end(self) -> None:
        """``streamer.end()``, once every token is handed on."""
        self.streamer.end()


_SIDE: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    stream = _SIDE.get(device)
    if stream is None:
        stream = _SIDE[device] = torch.cuda.Stream(device)
    return stream
