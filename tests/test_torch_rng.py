"""grape.torch.rng without a GPU: reading a captured philox argument, and what a launch
writes and moves on."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.ir import Kernel, Param  # noqa: E402
from grape.torch import rng  # noqa: E402


def _kernel(flag: int, seed: int = 0x7F0000001000, offset: int = 0x7F0000001008) -> Kernel:
    # distribution_elementwise_grid_stride_kernel(int numel, PhiloxCudaState seeds, ...):
    # 4 bytes of numel, 4 of padding, then the state: seed pointer, offset pointer, the
    # offset within the graph, the captured flag, padding (here not zero).
    state = (seed.to_bytes(8, "little") + offset.to_bytes(8, "little")
             + (12).to_bytes(4, "little") + bytes([flag]) + b"\xaa\xbb\xcc")
    args = (1).to_bytes(4, "little") + bytes(4) + state + bytes(8)
    return Kernel("rand@0x1", "distribution_elementwise_grid_stride_kernel", (1, 1, 1),
                  (256, 1, 1), args=args,
                  params=(Param(0, 4), Param(8, 24), Param(32, 1), Param(33, 1)))


def test_a_captured_philox_argument_gives_the_seed_and_offset_addresses():
    assert rng._philox(_kernel(1)) == (0x7F0000001000, 0x7F0000001008)


def test_the_32_byte_state_of_torch_2_11_is_read_too():
    # Read from a captured torch.rand(1) on the H200 (torch 2.11+cu130): int64 numel, then a
    # 32-byte state whose offset within the graph is 64-bit, its flag at byte 24; then the
    # functors' bytes.
    state = bytes.fromhex("0000a07ec47f00000002a07ec47f0000"
                          "00000000000000000100000000000000")
    args = (1).to_bytes(8, "little") + state + bytes(8) + bytes(24)
    kernel = Kernel("rand@0x3", "distribution_elementwise_grid_stride_kernel", (1, 1, 1),
                    (256, 1, 1), args=args,
                    params=(Param(0, 8), Param(8, 32), Param(40, 1), Param(48, 24)))
    assert rng._philox(kernel) == (0x7FC47EA00000, 0x7FC47EA00200)
    flag_down = args[:32] + b"\x00" + args[33:]
    assert rng._philox(Kernel("rand@0x3", "r", (1, 1, 1), (1, 1, 1), args=flag_down,
                              params=kernel.params)) is None


def test_an_argument_not_captured_or_not_pointers_is_not_taken():
    assert rng._philox(_kernel(0)) is None  # eager: the words are values, not pointers
    assert rng._philox(_kernel(1, seed=0x7F0000001003)) is None  # not aligned
    assert rng._philox(Kernel("k@0x2", "k", (1, 1, 1), (1, 1, 1), args=bytes(8),
                              params=(Param(0, 8),))) is None


class _Generator:
    def __init__(self) -> None:
        self.offset = 40

    def initial_seed(self) -> int:
        return 1234

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


def test_each_launch_writes_the_seed_and_offset_and_moves_the_generator_past_it(monkeypatch):
    written = []
    monkeypatch.setattr("grape.cuda.context.fill_u64_async",
                        lambda dst, value, stream: written.append((dst, value, stream)))
    gen = _Generator()
    random = rng.GraphRandom(gen, 0x1000, 0x1008)
    random.before_launch(7)
    random.before_launch(7)
    assert written == [(0x1000, 1234, 7), (0x1008, 40, 7),
                       (0x1000, 1234, 7), (0x1008, 40 + rng.STRIDE, 7)]
    assert gen.offset == 40 + 2 * rng.STRIDE and random.launches == 2
    assert rng.STRIDE % 4 == 0
