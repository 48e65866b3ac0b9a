"""How a graphed callable brings a shared executable to a call (grape.torch.graphed), on the
CPU: synthetic graphs, a recording stand-in for the driver."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="torch is not installed")
driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")

import grape.torch.graphed as graphed_module  # noqa: E402
from grape.errors import GrapeError, UnsupportedError  # noqa: E402
from grape.ir import Buffer, BufferRole, Kernel, KernelGraph, Param, Pointer, Span  # noqa: E402
from grape.passes.delta import delta, join  # noqa: E402
from grape.torch.aliasing import Inputs  # noqa: E402
from grape.torch.graphed import Graphed, _Entry, _Shared  # noqa: E402
from tests.standins import RecordingGraph  # noqa: E402


def _step(tag: str, x: torch.Tensor, grid: int) -> KernelGraph:
    """Five kernels in a chain; the first reads input ``x``, the third's grid is ``grid``."""
    g = KernelGraph()
    name = f"{tag}input0"
    address = x.untyped_storage().data_ptr()
    g.add_buffer(Buffer(name, x.nbytes, BufferRole.INPUT, address=address))
    previous: list[str] = []
    for i in range(5):
        pointers = (Pointer(0, Span(name)),) if i == 0 else ()
        args = address.to_bytes(8, "little") if i == 0 else i.to_bytes(8, "little")
        node = f"{tag}k{i}"
        g.add(node, Kernel(f"f{i}@0x{i}", f"f{i}", (grid if i == 2 else 1, 1, 1), (32, 1, 1),
                           args=args, params=(Param(0, 8),), pointers=pointers), after=previous)
        previous = [node]
    return g


class _Executable:
    handle = "executable"

    def __init__(self, log: list, refuse: bool = False) -> None:
        self.log, self.refuse = log, refuse

    def update(self, graph) -> None:
        if self.refuse:
            raise UnsupportedError("refused")
        self.log.append(("whole", graph.ir))


def _family(refuse: bool = False):
    log: list = []
    xa, xb = torch.zeros(4), torch.zeros(8)
    template = _step("s0/", xa, 1)
    member = _step("s1/", xb, 3)
    shared = _Shared(template, RecordingGraph(log, template), _Executable(log, refuse))
    a = _Entry(None, template, shared, delta(template, template),
               {n: n for n in template.dag}, Inputs.of([xa], "s0/"), frozenset({"s0/k0"}),
               frozenset({"s0/k0"}), shared.graph, (xa.untyped_storage().data_ptr(),))
    d = join(template, member)
    b = _Entry(None, member, shared, d, dict(d.mapping), Inputs.of([xb], "s1/"),
               frozenset({"s0/k0"}), frozenset({"s0/k0"}) | {nd.node for nd in d.nodes},
               RecordingGraph(log, member), (xb.untyped_storage().data_ptr(),))
    shared.holds = a
    return Graphed(lambda x: x), a, b, xa, xb, log


def _pointer(op) -> int:
    return int.from_bytes(op.args[:8], "little")


def test_a_call_where_the_inputs_lie_updates_nothing_and_a_moved_input_one_node():
    g, a, _, xa, _, log = _family()
    g._bring(a, [xa])
    assert log == []
    moved = torch.zeros(4)
    g._bring(a, [moved])
    assert [node for node, _ in log] == ["s0/k0"]
    assert _pointer(log[0][1]) == moved.untyped_storage().data_ptr()
    assert g.stats.pointer_updates == 1 and g.stats.switches == 0


def test_switching_signatures_updates_what_either_changes_with_the_callers_own():
    g, a, b, xa, xb, log = _family()
    g._bring(b, [xb])  # 2 of 5 nodes: node by node
    assert sorted(node for node, _ in log) == ["s0/k0", "s0/k2"]
    set_to = dict(log)
    assert set_to["s0/k2"].grid == (3, 1, 1)
    assert _pointer(set_to["s0/k0"]) == xb.untyped_storage().data_ptr()
    log.clear()
    g._bring(a, [xa])  # and back: the template's own parameters
    assert dict(log)["s0/k2"].grid == (1, 1, 1)
    assert _pointer(dict(log)["s0/k0"]) == xa.untyped_storage().data_ptr()
    assert g.stats.switches == 2 and g.stats.switch_updates == 4 and a.shared.holds is a


def test_a_switch_that_changes_most_nodes_is_one_whole_graph_update(monkeypatch):
    monkeypatch.setattr(graphed_module, "_WHOLE", 0.1)
    g, a, b, xa, xb, log = _family()
    g._bring(b, [xb])
    assert log == [("whole", b.graph.ir)]  # its input lies where its graph reads it
    log.clear()
    g._bring(b, [xb])  # the same signature, the same place: nothing
    assert log == []
    g._bring(a, [xa])
    log.clear()
    moved = torch.zeros(8)  # b's input elsewhere: its whole graph, then its input re-pointed
    g._bring(b, [moved])
    assert log[0] == ("whole", b.graph.ir)
    assert [node for node, _ in log[1:]] == ["s0/k0"]
    assert _pointer(log[1][1]) == moved.untyped_storage().data_ptr()
    assert g.stats.whole_updates == 3


def test_a_whole_graph_update_the_driver_refuses_goes_node_by_node(monkeypatch):
    monkeypatch.setattr(graphed_module, "_WHOLE", 0.1)
    g, _, b, _, xb, log = _family(refuse=True)
    g._bring(b, [xb])
    assert b.graph is None and sorted(node for node, _ in log) == ["s0/k0", "s0/k2"]
    assert g.stats.whole_updates == 0 and g.stats.switches == 1


def test_arguments_a_graph_cannot_take_are_refused_before_any_capture():
    g = Graphed(lambda *a, **k: None)
    with pytest.raises(GrapeError, match="expected CUDA tensors as inputs of a graphed "
                                         "callable, found one on cpu"):
        g(torch.ones(2), scale=1.0)
    with pytest.raises(GrapeError, match="expected CUDA tensors"):  # nested in a keyword
        g(pair=(1, torch.ones(2)))
    with pytest.raises(GrapeError, match="expected tensors and hashable values as arguments, "
                                         "found a bytearray"):
        g(bytearray(b"x"))
    assert g.stats.captures == 0 and g.signatures == 0


class _Captured:
    """What ``_dag`` reads of a capture: its chain, and each operation's memory."""

    def __init__(self, ir: KernelGraph, accesses: list) -> None:
        self.ir, self.accesses, self.allocations = ir, accesses, None


def _two_independent_operations() -> _Captured:
    """Two operations in a chain, each writing a buffer of its own: nothing orders them."""
    from grape.passes.concurrency import OpAccess

    g = KernelGraph()
    base = 0x7F00_0000_0000
    for i in range(2):
        g.add_buffer(Buffer(f"b{i}", 256, BufferRole.INTERNAL, address=base + 256 * i))
    previous: list[str] = []
    for i in range(2):
        node = f"k{i}"
        g.add(node, Kernel(f"f{i}@0x{i}", f"f{i}", (1, 1, 1), (32, 1, 1),
                           args=(base + 256 * i).to_bytes(8, "little"), params=(Param(0, 8),),
                           pointers=(Pointer(0, Span(f"b{i}")),)), after=previous)
        previous = [node]
    accesses = [OpAccess(i, writes=((base + 256 * i, 256),), name=f"op{i}") for i in range(2)]
    return _Captured(g, accesses)


def test_a_concurrent_signature_runs_the_dag_its_memory_demands():
    captured = _two_independent_operations()
    chain, depth = Graphed(lambda x: x)._dag(captured)
    assert chain is captured.ir and depth == 2
    dag, depth = Graphed(lambda x: x, concurrent=True)._dag(captured)
    assert depth == 1 and len(dag) == 2 and dag.dag.number_of_edges() == 0


def test_a_capture_the_concurrency_pass_cannot_take_keeps_its_chain_with_a_warning():
    captured = _two_independent_operations()
    captured.accesses = captured.accesses[::-1]  # operations out of the graph's order
    with pytest.warns(UserWarning, match=r"grape.graphed\(concurrent=True\): the capture runs "
                                         r"as captured, one operation after another: expected"):
        ir, depth = Graphed(lambda x: x, concurrent=True)._dag(captured)
    assert ir is captured.ir and depth == 2


def test_concurrent_must_be_a_bool():
    import grape

    with pytest.raises(GrapeError, match="expected concurrent=True or False, found 'yes'"):
        grape.graphed(lambda x: x, concurrent="yes")


def test_an_argument_in_an_output_s_memory_is_copied_once_warned_its_signature_kept():
    g = Graphed(lambda x: x)
    out = torch.arange(8, dtype=torch.float32)  # stands for a graph's output
    storage = out.untyped_storage()
    g._add_written(storage.data_ptr(), storage.data_ptr() + storage.nbytes())
    inside, elsewhere = out[2:6], torch.zeros(4)
    assert g._inside_output(inside) and g._inside_output(out)
    assert not g._inside_output(elsewhere)
    with pytest.warns(UserWarning, match="an argument lies in the memory of an output of an "
                                         "earlier call"):
        copy = g._apart(inside)
    assert copy.untyped_storage().data_ptr() != storage.data_ptr()
    assert (copy.shape, copy.stride(), copy.storage_offset()) == ((4,), (1,), 2)
    assert torch.equal(copy, inside) and g.stats.copy_bytes == 32  # the whole storage
    out.fill_(-1)  # the graph writes its output: the copy keeps what the caller passed
    assert copy.tolist() == [2.0, 3.0, 4.0, 5.0]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per callable
        g._apart(inside)
    assert g.stats.copy_bytes == 64


def test_only_outputs_in_the_graphs_pool_count_as_written(monkeypatch):
    pooled, callers = torch.zeros(16), torch.zeros(4)
    start = pooled.untyped_storage().data_ptr()
    monkeypatch.setattr(graphed_module, "pool_segments", lambda pool: [(start, 64)])
    g = Graphed(lambda x: x)
    # An output made in the pool, and one that is the caller's own argument (an in-place
    # function's result, or a view of an input): only the first is memory a launch writes.
    g._note_written((pooled[4:], {"same": callers}))
    assert g._written == [(start, start + 64)]
    assert g._inside_output(pooled[:2]) and not g._inside_output(callers)


def test_written_ranges_merge_and_one_bisection_finds_an_overlap():
    g = Graphed(lambda x: x)
    for a, b in [(100, 200), (300, 400), (150, 250), (400, 450), (1000, 1001)]:
        g._add_written(a, b)
    assert g._written == [(100, 250), (300, 450), (1000, 1001)]

    class At:  # a tensor's storage at [start, end)
        def __init__(self, start, end):
            self.start, self.end = start, end

        def untyped_storage(self):
            return self

        def data_ptr(self):
            return self.start

        def nbytes(self):
            return self.end - self.start

    inside = [(0, 101), (249, 260), (260, 301), (449, 999), (999, 2000), (120, 130)]
    outside = [(0, 100), (250, 300), (450, 1000), (1001, 5000)]
    assert all(g._inside_output(At(*r)) for r in inside)
    assert not any(g._inside_output(At(*r)) for r in outside)


_RANGE = st.tuples(st.integers(0, 200), st.integers(1, 40)).map(lambda p: (p[0], p[0] + p[1]))


@settings(max_examples=300, deadline=None)
@given(st.lists(_RANGE, max_size=12), _RANGE)
def test_an_overlap_is_found_as_a_scan_of_every_output_finds_it(outputs, probe):
    g = Graphed(lambda x: x)
    for a, b in outputs:
        g._add_written(a, b)

    class At:
        def untyped_storage(self):
            return self

        def data_ptr(self):
            return probe[0]

        def nbytes(self):
            return probe[1] - probe[0]

    assert g._inside_output(At()) == any(a < probe[1] and probe[0] < b for a, b in outputs)


def test_threads_calling_one_graphed_callable_take_turns(monkeypatch):
    import threading
    import time
    from types import SimpleNamespace

    log: list[tuple[str, str]] = []

    class Launches:
        def launch(self, stream):
            log.append(("launch", threading.current_thread().name))

    entry = SimpleNamespace(shared=SimpleNamespace(executable=Launches()), captured=SimpleNamespace(
        outputs="out"))
    g = Graphed(lambda x: x)

    def bring(e, tensors):  # slow enough that an unlocked second call would interleave
        log.append(("bring", threading.current_thread().name))
        time.sleep(0.05)

    monkeypatch.setattr(g, "_entry", lambda args, kwargs: (entry, []))
    monkeypatch.setattr(g, "_bring", bring)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda: SimpleNamespace(cuda_stream=0))
    threads = [threading.Thread(target=g, name=f"t{i}") for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Each thread's bring is followed by its own launch, never by another thread's bring.
    assert len(log) == 6 and all(log[i][1] == log[i + 1][1] and log[i][0] == "bring"
                                 for i in range(0, 6, 2)), log
    assert g.stats.calls == 3


def test_the_modules_a_callable_runs_are_found_where_it_holds_them():
    # grape.graphed switches the experts of the modules fn runs (grape.torch.experts): the
    # module called, the one whose method is, what a partial binds, what a closure holds
    import functools

    from grape.torch.graphed import modules_of

    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert modules_of(model) == [model]
    assert modules_of(model.forward) == [model]
    assert modules_of(lambda x: model(x)) == [model]
    assert modules_of(functools.partial(lambda m, x: m(x), other)) == [other]

    def outer():
        def inner(x):
            return model(x) + other(x)
        return inner

    assert {id(m) for m in modules_of(outer())} == {id(model), id(other)}

    def ping(x):  # closures that hold each other end the search
        return pong(x)

    def pong(x):
        return ping(model(x))

    assert modules_of(ping) == [model]
    assert modules_of(torch.relu) == []
