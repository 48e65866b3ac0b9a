"""Branches on several streams as they share the GPU's SMs (grape.sim.sharing), and the share a
kernel's grid asks for (grape.records.sm_share)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grape.errors import TraceFormatError
from grape.program import GpuWork, Launch, StreamWait
from grape.records import GpuRecord, sm_share
from grape.sim.sharing import branch_time
from grape.trace import _device


def _kernel(stream, dur, share=1.0):
    return Launch("cudaLaunchKernel", 1.0, (GpuWork("kernel", "k", dur, stream, share=share),))


def test_kernels_that_fit_the_gpu_together_run_at_their_own_pace():
    steps = [_kernel(0, 10.0, 0.5), _kernel(1, 10.0, 0.5)]
    assert branch_time(steps, 0.0) == pytest.approx(10.0)


def test_kernels_that_ask_for_more_than_the_gpu_share_it():
    # Two 88-block kernels on a 132-SM GPU: 4/3 of the GPU asked for, each at 3/4 pace.
    steps = [_kernel(0, 12.0, 88 / 132), _kernel(1, 12.0, 88 / 132)]
    assert branch_time(steps, 0.0) == pytest.approx(16.0)
    assert branch_time(steps, 0.0, shared=False) == pytest.approx(12.0)


def test_a_kernel_runs_at_its_own_pace_again_once_the_other_ends():
    # Both at half pace for 8 us (4 us of work each), then the longer alone for its other 8.
    steps = [_kernel(0, 4.0), _kernel(1, 12.0)]
    assert branch_time(steps, 0.0) == pytest.approx(16.0)


def test_a_wait_holds_a_stream_until_the_work_queued_before_it_has_run():
    steps = [_kernel(0, 5.0), _kernel(0, 5.0), StreamWait(1, 0), _kernel(0, 7.0),
             _kernel(1, 3.0, 0.1)]
    # Stream 1 waits for stream 0's first two kernels only, then runs beside the third.
    assert branch_time(steps, 1.0, shared=False) == pytest.approx(3 * 1.0 + 17.0)
    # Beside it, the third asks with the other for 1.1 of the GPU for 3 us: 10/11 pace.
    assert branch_time(steps, 1.0) > branch_time(steps, 1.0, shared=False)


def _chain(steps, per_node):
    """The longest chain the waits order, each kernel at its own pace (the what-if's pricing
    before sharing): the reference for overlap at alone speed."""
    ready = {}
    for step in steps:
        if isinstance(step, Launch):
            for w in step.work:
                ready[w.stream] = ready.get(w.stream, 0.0) + w.dur + per_node
        else:
            ready[step.stream] = max(ready.get(step.stream, 0.0), ready.get(step.on, 0.0))
    return max(ready.values(), default=0.0)


_steps = st.lists(st.one_of(
    st.builds(_kernel, st.integers(0, 3), st.floats(0.0, 50.0), st.floats(0.01, 1.0)),
    st.builds(StreamWait, st.integers(0, 3), st.integers(0, 3))), max_size=40)


@given(_steps, st.sampled_from([0.0, 0.35, 2.0]))
def test_sharing_lies_between_overlap_at_alone_speed_and_one_after_the_other(steps, per_node):
    overlapped = branch_time(steps, per_node, shared=False)
    shared = branch_time(steps, per_node)
    work = [w for s in steps if isinstance(s, Launch) for w in s.work]
    serial = sum(w.dur for w in work) + per_node * len(work)
    assert overlapped == pytest.approx(_chain(steps, per_node), abs=1e-6)
    assert overlapped - 1e-6 <= shared <= serial + 1e-6


def _record(grid, kind="kernel"):
    return GpuRecord(kind, "k", 0.0, 1.0, 7, 1, grid=grid, block=(128, 1, 1))


def test_a_kernel_holds_the_share_of_the_sms_its_blocks_spread_over():
    assert sm_share(_record((4, 22, 1)), 132) == pytest.approx(2 / 3)
    assert sm_share(_record((1024, 1, 1)), 132) == 1.0
    # What the trace does not say holds the whole GPU: the pricing before shares.
    assert sm_share(_record(None), 132) == 1.0
    assert sm_share(_record((1, 1, 1)), None) == 1.0
    assert sm_share(_record((1, 1, 1), kind="memcpy"), 132) == 1.0


@pytest.mark.parametrize("sms", [0, -3, 13.5, "132", True])
def test_a_malformed_sm_count_is_refused_where_the_trace_is_read(sms):
    with pytest.raises(TraceFormatError, match="expected the device's 'numSms' a positive "
                                               "integer"):
        _device([{"name": "NVIDIA H200", "numSms": sms}], "t.json")
