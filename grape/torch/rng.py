"""Random numbers in grape's graphs: PyTorch's philox generator, moved on at every launch.

A kernel that draws random numbers (dropout, ``torch.rand``) captured by PyTorch does not hold
its seed and offset: it holds pointers to two device words that the generator owns (one seed
and one offset for every graph of that generator) and its own offset within the graph.
PyTorch's ``CUDAGraph.replay`` writes the generator's seed and current offset into those words
before each launch and moves the offset on by what the graph draws, so each replay draws new
numbers. grape launches its own executables, without that prologue: every launch would draw
the numbers the last PyTorch replay (or the capture) left there, the same dropout masks step
after step.

:class:`GraphRandom` is that prologue for grape's launches. It finds the two words' addresses
by capturing one ``torch.rand`` and reading its kernel's philox argument (PyTorch's
``PhiloxCudaState``: seed pointer, offset pointer, offset within the graph, a captured flag;
24 bytes with a 32-bit offset within the graph, 32 bytes where that offset is 64-bit, as in
torch 2.11 on the H200),
checks them by letting PyTorch's own replay write them and reading them back, and then, before
each launch, writes the seed and the generator's offset there (two memsets on the launch's
stream) and moves the generator on by ``stride``. The stride is a bound, not the graph's exact
draw (which PyTorch keeps to itself): 2**32 per launch, far above what any step draws, so no two
launches, nor eager work around them, ever draw overlapping numbers. The numbers are PyTorch's
generator's, seeded by ``torch.manual_seed``, but not the ones eager steps would draw: with
random draws in a step, graphed training is reproducible run to run, not equal to eager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from grape.errors import UnsupportedError
from grape.ir import Kernel

__all__ = ["GraphRandom"]

STRIDE = 1 << 32  # philox offset per launch: a bound on any step's draw, a multiple of 4
# PhiloxCudaState's size -> where its captured flag sits: two 8-byte words (seed and offset
# pointers), the offset within the graph (4 or 8 bytes), the flag, padding.
_FLAG_AT = {24: 20, 32: 24}


@dataclass
class GraphRandom:
    generator: torch.Generator
    seed_address: int
    offset_address: int
    stride: int = STRIDE
    launches: int = 0
    # The probe's PyTorch graph, kept: the generator frees the two words when its last
    # registered graph goes, and allocates them anew (elsewhere) for the next one.
    keep: Any = field(default=None, repr=False)

    @classmethod
    def probe(cls, device: torch.device | str | int = "cuda") -> GraphRandom:
        """Find the words the default CUDA generator's graphs read, on ``device``.

        Raises
        ------
        UnsupportedError
            The captured kernel holds no philox argument grape recognises, or the words it
            points to do not hold what PyTorch's replay writes (another PyTorch layout).
        """
        from grape.cuda.context import read_device
        from grape.torch.capture import capture

        device = torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        out = torch.empty(1, device=device)
        cap = capture(lambda: torch.rand(1, out=out), warmup=1, collect=False)
        found = [_philox(op) for _, op in cap.ir.ops() if isinstance(op, Kernel)]
        found = [f for f in found if f is not None]
        if len(found) != 1:
            raise UnsupportedError(f"expected one kernel with a captured philox argument in a "
                                   f"graph of torch.rand, found {len(found)}")
        seed_address, offset_address = found[0]
        # PyTorch's replay writes the seed and the offset it stands at: read them back.
        offset = generator.get_offset()
        cap.torch_graph.replay()
        torch.cuda.synchronize()
        seed = int.from_bytes(read_device(seed_address, 8), "little")
        written = int.from_bytes(read_device(offset_address, 8), "little")
        if (seed, written) != (generator.initial_seed(), offset):
            raise UnsupportedError(f"expected the philox words at {seed_address:#x} and "
                                   f"{offset_address:#x} to hold seed {generator.initial_seed()}"
                                   f" and offset {offset} after a replay, found {seed} and "
                                   f"{written}")
        return cls(generator, seed_address, offset_address, keep=cap.torch_graph)

    def before_launch(self, stream: int) -> None:
        """Give the next launch on ``stream`` fresh numbers: the generator's seed and offset
        written where its graphs read them, and the generator moved on past them."""
        from grape.cuda.context import fill_u64_async

        offset = self.generator.get_offset()
        fill_u64_async(self.seed_address, self.generator.initial_seed(), stream)
        fill_u64_async(self.offset_address, offset, stream)
        self.generator.set_offset(offset + self.stride)
        self.launches += 1


def _philox(op: Kernel) -> tuple[int, int] | None:
    """The seed and offset addresses of a kernel's captured philox argument: a parameter of
    ``PhiloxCudaState``'s size whose flag says captured and whose words are pointers."""
    for p in op.params:
        flag = _FLAG_AT.get(p.size)
        if flag is None or p.offset + p.size > len(op.args):
            continue
        raw = op.args[p.offset:p.offset + p.size]
        if raw[flag] != 1:  # captured_ (the bytes after it are padding, whatever they hold)
            continue
        seed = int.from_bytes(raw[0:8], "little")
        offset = int.from_bytes(raw[8:16], "little")
        if seed and offset and seed % 8 == 0 and offset % 8 == 0:
            return seed, offset
    return None
