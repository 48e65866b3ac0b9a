"""grape.cuda.compare.Comparison's bookkeeping, without a device: the executable, the saved
state and a run stood in for, a run's result being what the kernels it holds read (the GPU
test ``test_a_comparison_kept_for_several_graphs_sets_their_nodes_in_one_executable`` runs the
real thing)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest

pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed")

from grape.cuda import compare
from grape.errors import GrapeError
from grape.ir import Buffer, BufferRole, Kernel, KernelGraph, Param

READ = slice(0, 4)  # the argument bytes a stand-in kernel reads; the rest are never read


def _graph(values: list[int], prefix: str = "k") -> KernelGraph:
    """A chain of kernels, each with a read word (its value) and an unread one."""
    g = KernelGraph()
    g.add_buffer(Buffer("out", 64, BufferRole.OUTPUT, address=0x1000))
    last = None
    for i, v in enumerate(values):
        node = f"{prefix}{i}"
        g.add(node, Kernel(f"fn{i}@0x{i + 1:x}", f"fn{i}", grid=(1, 1, 1), block=(32, 1, 1),
                           args=v.to_bytes(4, "little") + bytes(4),
                           params=(Param(0, 4), Param(4, 4))),
              after=[last] if last else [])
        last = node
    return g


class _Executable:
    def __init__(self, graph: _Graph) -> None:
        self.ops = dict(graph.ir.ops())
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Graph:
    built: ClassVar[list[KernelGraph]] = []

    def __init__(self, ir: KernelGraph) -> None:
        self.ir = ir

    @classmethod
    def build(cls, ir: KernelGraph) -> _Graph:
        cls.built.append(ir)
        return cls(ir)

    def instantiate(self, stream=0) -> _Executable:
        return _Executable(self)

    def prepare(self, ops):
        for node, op in ops.items():
            if node not in self.ir.dag:
                raise GrapeError(f"no node {node!r}")
            if op.attributes != self.ir.op(node).attributes:
                raise compare.UnsupportedError("attributes")
        return [(node, op) for node, op in ops.items()]

    @staticmethod
    def apply(executable: _Executable, updates) -> None:
        for node, op in updates:
            executable.ops[node] = op

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class _Kept:
    restored = 0

    def __init__(self, buffers) -> None:
        pass

    def retake(self) -> None:
        pass

    def restore(self) -> None:
        _Kept.restored += 1

    def free(self) -> None:
        pass


_device: list[bytes] = [b""]  # what the last run left: the stand-in device's buffers


def _launched(executable: _Executable, stream) -> None:
    """A run leaves the words its kernels read, in the executable's order."""
    _device[0] = b"".join(op.args[READ] for _, op in sorted(executable.ops.items()))


class _Left:
    def __init__(self, buffers, stream) -> None:
        self.kept = _device[0]

    def retake(self) -> None:
        self.kept = _device[0]

    def again(self) -> bool:
        return _device[0] == self.kept

    def free(self) -> None:
        pass


@pytest.fixture
def standins(monkeypatch):
    _Graph.built = []
    monkeypatch.setattr(compare, "Graph", _Graph)
    monkeypatch.setattr(compare, "_Kept", _Kept)
    monkeypatch.setattr(compare, "_launched", _launched)
    monkeypatch.setattr(compare, "_Left", _Left)
    monkeypatch.setattr(compare, "synchronize", lambda: None)
    return _Graph


def _with_word(g: KernelGraph, node: str, at: int, value: int) -> KernelGraph:
    op = g.op(node)
    args = op.args[:at] + value.to_bytes(4, "little") + op.args[at + 4:]
    return g.with_ops({node: dataclasses.replace(op, args=args)})


def test_graphs_of_one_structure_are_compared_in_the_first_ones_executable(standins):
    first = _graph([1, 2, 3])
    with compare.Comparison(first) as c:
        assert c.alike(_with_word(first, "k1", 4, 99))  # an unread word: alike
        assert not c.alike(_with_word(first, "k1", 0, 99))  # a read one: not
        assert c.alike(first)
        # Each comparison set its nodes back: the executable runs the first graph again
        assert dict(c.executable.ops) == dict(first.ops())
        assert c.updated == 3 and standins.built == [first]  # nothing else built


def test_another_graphs_node_ids_are_taken_through_the_pairs_given(standins):
    first, renamed = _graph([1, 2, 3]), _graph([1, 2, 3], prefix="other")
    pairs = {f"k{i}": f"other{i}" for i in range(3)}
    with compare.Comparison(first) as c:
        assert c.alike(renamed, pairs)
        assert not c.alike(_with_word(renamed, "other2", 0, 7), pairs)
        assert c.updated == 2 and standins.built == [first]
        # Without pairs, other ids: built whole, and still compared right
        assert c.alike(renamed)
        assert standins.built == [first, renamed] and c.updated == 2


def test_a_graph_of_the_same_node_ids_and_another_structure_is_built_whole(standins):
    # Two captures of different steps both number their nodes k0, k1, ...: the ids say nothing
    first = _graph([1, 2, 3])
    other = KernelGraph()
    other.add_buffer(first.buffers["out"])
    for node in ("k0", "k1", "k2"):  # no edges: another structure
        other.add(node, first.op(node))
    with compare.Comparison(first) as c:
        assert c.alike(other)  # the stand-in's runs read the same words
        assert standins.built == [first, other] and c.updated == 0


def test_a_change_the_executable_cannot_take_builds_the_graph_whole(standins):
    first = _graph([1, 2])
    op = first.op("k0")
    clustered = first.with_ops({"k0": dataclasses.replace(
        op, attributes=(("cluster", (2, 1, 1)),))})
    with compare.Comparison(first) as c:
        assert c.alike(clustered)  # reads the same words, so alike, but built to be run
        assert standins.built == [first, clustered] and c.updated == 0


def test_a_graph_with_other_buffers_is_refused_in_one_line(standins):
    first = _graph([1])
    other = _graph([1])
    other.buffers["out"] = Buffer("out", 64, BufferRole.OUTPUT, address=0x2000)
    with compare.Comparison(first) as c, pytest.raises(
            GrapeError, match="expected the graphs to compare to share their buffers, found "
                              "'out' only in the second or laid out otherwise"):
        c.alike(other)


def test_runs_alike_is_one_comparison(standins):
    first = _graph([5, 6])
    assert compare.runs_alike(first, _with_word(first, "k0", 4, 1))
    assert not compare.runs_alike(first, _with_word(first, "k0", 0, 1))
    assert standins.built == [first, first]  # one build a call, none for the second graph


def test_a_comparison_takes_another_first_of_its_structure_in_its_executable(standins):
    first = _graph([1, 2, 3])
    other_length = _with_word(first, "k2", 0, 30)  # the next sample: a read word changed
    with compare.Comparison(first) as c:
        assert c.rebase(other_length) and c.first is other_length and c.rebased == 1
        # compared with the new first now: its own graph agrees, the old first does not
        assert c.alike(other_length) and not c.alike(first)
        assert c.alike(_with_word(other_length, "k0", 4, 5))  # an unread word of it
        assert standins.built == [first]  # nothing built but the first executable
        # The same first again (a capture changed the state since): taken anew too
        assert c.rebase(other_length) and c.rebased == 2


def test_a_first_of_another_structure_or_memory_is_not_taken_in(standins):
    first = _graph([1, 2])
    renamed = _graph([1, 2], prefix="other")  # one structure, other ids: no pairs to go by
    moved = _graph([1, 2])
    moved.buffers["out"] = Buffer("out", 64, BufferRole.OUTPUT, address=0x2000)
    clustered = first.with_ops({"k0": dataclasses.replace(
        first.op("k0"), attributes=(("cluster", (2, 1, 1)),))})
    with compare.Comparison(first) as c:
        for g in (renamed, moved, clustered):
            assert not c.rebase(g)
        assert c.first is first and c.rebased == 0
        assert c.alike(first) and not c.alike(_with_word(first, "k1", 0, 9))


def test_a_rebase_that_fails_closes_the_comparison_once(standins, monkeypatch):
    first = _graph([1, 2])
    c = compare.Comparison(first)
    restored = _Kept.restored

    def failing(executable, stream):
        raise GrapeError("the device failed")

    monkeypatch.setattr(compare, "_launched", failing)
    with pytest.raises(GrapeError, match="the device failed"):
        c.rebase(_with_word(first, "k1", 0, 7))
    assert c.closed and c.executable.closed
    c.close()  # its owner closes it too: nothing is put back or freed twice
    assert _Kept.restored == restored + 1
