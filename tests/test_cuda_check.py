"""The driver-call checker; CPU tests need cuda-bindings, gpu tests a device."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed")

from cuda.bindings import driver

from grape.cuda.check import call, device_status
from grape.errors import CudaError

HAVE_DEVICE, WHY = device_status()


@pytest.mark.skipif(HAVE_DEVICE, reason="a CUDA device is present")
def test_no_driver_is_one_clear_error_at_first_use_not_at_import():
    assert "while initialising the CUDA driver" in WHY
    with pytest.raises(CudaError, match="while counting devices$"):
        call(driver.cuDeviceGetCount, doing="counting devices")


@pytest.mark.gpu
def test_failed_call_names_the_error_and_what_grape_was_doing():
    call(driver.cuInit, 0, doing="initialising")
    with pytest.raises(CudaError, match=r"^CUDA_ERROR_INVALID_DEVICE: invalid device ordinal, "
                                        r"while opening device 9999$"):
        call(driver.cuDeviceGet, 9999, doing="opening device 9999")


@pytest.mark.gpu
def test_device_status_names_the_device():
    assert HAVE_DEVICE and WHY.startswith("NVIDIA")


def test_an_observer_wraps_the_observed_driver_calls_and_no_others():
    import contextlib

    from grape.cuda.check import observe

    def cuGraphLaunch(*args):
        return (driver.CUresult.CUDA_SUCCESS,)

    def cuCtxGetDevice(*args):
        return (driver.CUresult.CUDA_SUCCESS, 3)

    seen = []

    @contextlib.contextmanager
    def span(name):
        seen.append(f"enter {name}")
        yield
        seen.append(f"exit {name}")

    with observe(span):
        call(cuGraphLaunch, 1, 2, doing="launching")
        assert call(cuCtxGetDevice, doing="asking") == 3
    call(cuGraphLaunch, doing="launching, unobserved")
    assert seen == ["enter cuGraphLaunch", "exit cuGraphLaunch"]


def test_applied_updates_are_called_directly_and_a_failure_names_its_node(monkeypatch):
    import contextlib

    from grape.cuda import check
    from grape.cuda.build import Graph, Update
    from grape.cuda.check import observe

    monkeypatch.setattr(check, "_describe", lambda status: f"{status.name}: described")
    made = []

    def cuGraphExecKernelNodeSetParams(handle, node, status):
        made.append((handle, node))
        return (status,)

    ok, bad = driver.CUresult.CUDA_SUCCESS, driver.CUresult.CUDA_ERROR_INVALID_VALUE

    class Executable:
        handle = "exec"

    updates = [Update(n, cuGraphExecKernelNodeSetParams, (n, s))
               for n, s in (("n0", ok), ("n1", bad), ("n2", ok))]
    with pytest.raises(CudaError, match=r"^CUDA_ERROR_INVALID_VALUE: described, while "
                                        r"updating node 'n1'$"):
        Graph.apply(Executable(), updates)
    assert made == [("exec", "n0"), ("exec", "n1")]  # none after the failure

    seen = []

    @contextlib.contextmanager
    def span(name):
        seen.append(name)
        yield

    with observe(span):  # observed: each update goes through the checker, which marks it
        Graph.apply(Executable(), [updates[0], updates[2]])
    assert seen == ["cuGraphExecKernelNodeSetParams"] * 2


def test_a_call_failing_for_want_of_a_context_is_made_again_once_one_is_current(monkeypatch):
    # A second thread generating with executables the first built: the runtime makes the
    # primary context current for its own calls, the driver saw none, and the launch failed
    # with CUDA_ERROR_INVALID_CONTEXT on the H200. The checker makes it current and calls again.
    import grape.cuda.check as check

    state = {"current": False, "calls": 0}

    def launch(*args):
        state["calls"] += 1
        if not state["current"]:
            return (driver.CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        return (driver.CUresult.CUDA_SUCCESS, 7)

    monkeypatch.setattr(check, "_thread_has_context", lambda: state["current"])
    monkeypatch.setattr(check, "_make_primary_current",
                        lambda: state.update(current=True) or True)
    monkeypatch.setattr(check, "_describe", lambda status: status.name)  # (no driver needed)
    assert call(launch, doing="launching") == 7 and state["calls"] == 2
    # A thread that had a context: the failure is the call's own, raised as it was.
    state.update(calls=0)
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_CONTEXT.*while launching$"):
        call(lambda: (driver.CUresult.CUDA_ERROR_INVALID_CONTEXT,), doing="launching")
