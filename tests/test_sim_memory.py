from __future__ import annotations

import bisect
import gzip
import json
from pathlib import Path

import pytest

from grape.errors import GrapeError
from grape.passes.places import History
from grape.sim.memory import MB, Pool, family_memory, round_size, segment_size

RECORDED = (Path(__file__).resolve().parent.parent / "traces" / "h200_pool"
            / "gpt2_small_decode_b1.histories.json.gz")


def test_rounding_and_segments_follow_the_caching_allocator():
    assert [round_size(n) for n in (1, 512, 513, 4096)] == [512, 512, 1024, 4096]
    assert segment_size(1) == segment_size(MB) == 2 * MB
    assert segment_size(MB + 1) == segment_size(10 * MB - 1) == 20 * MB
    assert segment_size(10 * MB + 1) == 12 * MB


def test_blocks_split_reuse_and_coalesce():
    pool = Pool()
    a = pool.malloc(1000)
    b = pool.malloc(1000)
    assert pool.reserved == 2 * MB and pool.allocated == 2048 and a != b
    pool.free(a)
    assert pool.malloc(500) == a  # best fit: a's block
    pool.free(a)
    pool.free(b)
    assert pool.allocated == 0
    assert pool.free_blocks == [(0, 0, 2 * MB)]  # the segment coalesced back into one block
    assert pool.malloc(MB) == (0, 0) and pool.reserved == 2 * MB


def test_small_and_large_requests_use_their_own_segments():
    pool = Pool()
    pool.malloc(100)
    pool.malloc(3 * MB)
    assert pool.segments == [2 * MB, 20 * MB]
    with pytest.raises(GrapeError, match="expected an allocated block"):
        pool.free((5, 0))


def test_a_large_block_splits_only_where_more_than_1_mib_is_left():
    # PyTorch's should_split: a large block gives a request all of itself where 1 MiB or less
    # would be left (a small one splits down to 512 bytes).
    pool = Pool()
    pool.malloc(19 * MB + MB // 2)  # a 20 MiB segment; half a MiB left: not split
    assert pool.allocated == 20 * MB and pool.free_blocks == []
    second = pool.malloc(3 * MB)  # another segment, split: 17 MiB stay free
    assert second == (1, 0) and pool.free_blocks == [(1, 3 * MB, 17 * MB)]
    pool.malloc(16 * MB)  # 1 MiB would be left: the whole block
    assert pool.free_blocks == [] and pool.allocated == 40 * MB
    small = Pool()
    small.malloc(MB)
    small.malloc(MB - 512)  # the 2 MiB segment's other half, 512 bytes left: split
    assert small.free_blocks == [(0, 2 * MB - 512, 512)] and small.allocated == 2 * MB - 512


def _shape(length: int) -> list[tuple[str, int, int]]:
    """A decode step's allocations: activations that grow with the KV length, all freed."""
    sizes = [length * 64 * 1024, 4 * MB, length * 2 * 1024]
    return ([("malloc", i, s) for i, s in enumerate(sizes)]
            + [("free", i, 0) for i in range(len(sizes))])


def test_one_shared_pool_captured_largest_first_keeps_only_the_largest_shape():
    shapes = [_shape(n) for n in (100, 300, 200)]
    private = family_memory(shapes, [290] * 3, 3000, shared_pool=False, shared_executable=False)
    shared = family_memory(shapes, [290] * 3, 3000, shared_pool=True, shared_executable=True)
    largest = Pool().run(_shape(300)).reserved
    assert private.pool_bytes == sum(Pool().run(s).reserved for s in shapes) > 2 * largest
    assert shared.pool_bytes == largest
    assert (private.graph_bytes, shared.graph_bytes) == (3 * 290 * 3000, 290 * 3000)
    assert shared.executables == 1 and private.executables == 3


def test_smallest_first_can_cost_more_than_largest_first():
    shapes = [_shape(n) for n in (10, 100, 300)]
    first_small = family_memory(shapes, [1] * 3, 0, shared_pool=True, shared_executable=True,
                                largest_first=False)
    first_large = family_memory(shapes, [1] * 3, 0, shared_pool=True, shared_executable=True)
    assert first_large.pool_bytes <= first_small.pool_bytes


@pytest.fixture(scope="module")
def recorded() -> dict[int, History]:
    with gzip.open(RECORDED, "rt") as f:
        data = json.load(f)
    return {int(n): History.of_json(h) for n, h in data["histories"].items()}


def test_the_pool_places_every_block_where_pytorch_did_on_the_h200(recorded):
    # GPT-2 small's decode step captured at 147 KV lengths (1..1023, every 7th, so every
    # residue modulo 8 and both of the step's attention paths), each into a private pool, with
    # the caching allocator's history recorded around the capture (benchmarks/pool_layout.py).
    assert len(recorded) == 147 and {len(h.acts) for h in recorded.values()} == {656, 680}
    blocks = 0
    for n, history in recorded.items():
        assert Pool().placements(history.requests()) == history.placed(), n
        blocks += len(history)
    assert blocks == 49_752


def test_a_pool_that_never_coalesces_misplaces_the_recorded_blocks(recorded, monkeypatch):
    # The comparison above can fail: with freed neighbours left apart, the same replays put
    # blocks elsewhere.
    def no_coalescing(self, handle):
        block = self._blocks[handle]
        block.free = True
        self.allocated -= block.size
        bisect.insort(self._free, (block.size, block.segment, block.offset))

    monkeypatch.setattr(Pool, "free", no_coalescing)
    wrong = [n for n, h in recorded.items() if Pool().placements(h.requests()) != h.placed()]
    assert len(wrong) == len(recorded)


def test_a_replay_refuses_a_free_of_what_was_never_allocated():
    with pytest.raises(GrapeError, match="never allocated or freed already"):
        Pool().placements([("malloc", 0, 512), ("free", 1, 0)])


def test_a_saved_familys_memory_against_per_shape_graphs_sharing_one_pool():
    from grape.sim.memory import saved_family_memory

    # GPT-2 small's two topologies over 1,023 lengths at the profile's 2,520 B a node, the
    # scratch and the tables of run 54 (H200): measured there 6.6 MB, and 922.7 MB for
    # per-shape graphs sharing one pool (their executables took more than the profile's fit).
    family, per_shape = saved_family_memory([(292, 511), (316, 512)], 2 * MB, 2_834_416,
                                            2520.0)
    assert (family.graph_bytes, family.executables) == (round(608 * 2520.0), 2)
    assert family.total == family.graph_bytes + 2 * MB + 2_834_416
    assert per_shape.executables == 1023 and per_shape.table_bytes == 0
    assert per_shape.total == round((292 * 511 + 316 * 512) * 2520.0) + 2 * MB
    assert 100 < per_shape.total / family.total < 150
    with pytest.raises(GrapeError, match="expected node and shape counts and byte sizes that "
                                         "are not negative, found"):
        saved_family_memory([(292, -1)], 0, 0, 2520.0)


def test_a_saved_familys_alternates_are_nodes_of_its_executables_alone():
    from grape.sim.memory import saved_family_memory

    # Shaped like Wav2Vec2's family on the H200 (node counts of its 8 executables, 287
    # alternates); how shapes and alternates split between executables is made up here.
    templates = [(482, 20), (481, 12), (482, 15), (482, 14), (483, 13), (493, 10),
                 (445, 9), (433, 8)]
    alternates = [48, 48, 48, 48, 48, 47, 0, 0]
    plain, _ = saved_family_memory(templates, 0, 0, 2520.0)
    family, per_shape = saved_family_memory(templates, 0, 0, 2520.0, alternates)
    assert family.graph_bytes - plain.graph_bytes == round(287 * 2520.0)
    assert per_shape.graph_bytes == round(sum(n * k for n, k in templates) * 2520.0)
    with pytest.raises(GrapeError, match="a count of alternates that is not negative for "
                                         "each of the 8 executables"):
        saved_family_memory(templates, 0, 0, 2520.0, [1, 2])
