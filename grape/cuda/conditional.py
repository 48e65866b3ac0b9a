"""Conditional nodes: capability checks and the small kernels that set conditions on the GPU.

A conditional node's handle is set on the device with ``cudaGraphSetConditional``, called from
a kernel that runs before the node (IF, IF/ELSE, SWITCH) or at the end of its body (WHILE), so
no host synchronisation decides a branch or ends a loop.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # nvrtc imports the builder, which imports the walk, which imports SETTERS
    from grape.cuda.nvrtc import Module

__all__ = ["SETTERS", "SOURCE", "condition_kernels"]

SOURCE = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

// The condition is a GPU value: a bool, or an int (a SWITCH case, or non-zero for IF/WHILE).
extern "C" __global__ void grape_set_from_bool(cudaGraphConditionalHandle h, const bool* v) {
    cudaGraphSetConditional(h, *v ? 1u : 0u);
}
extern "C" __global__ void grape_set_from_int(cudaGraphConditionalHandle h, const int* v) {
    cudaGraphSetConditional(h, (unsigned int)*v);
}
// A counted loop body's last step: count down and continue while the count is positive.
extern "C" __global__ void grape_count_down(cudaGraphConditionalHandle h, int* count) {
    *count -= 1;
    cudaGraphSetConditional(h, *count > 0 ? 1u : 0u);
}
// A data-dependent loop's last step, with a bound: go on while the body says so and the
// iterations left (counted down here) are not spent.
extern "C" __global__ void grape_while_bounded(cudaGraphConditionalHandle h, const bool* go,
                                               int* remaining) {
    *remaining -= 1;
    cudaGraphSetConditional(h, (*go && *remaining > 0) ? 1u : 0u);
}
"""


# The kernels above, each of which takes the handle it sets as its first parameter.
SETTERS = ("grape_set_from_bool", "grape_set_from_int", "grape_count_down", "grape_while_bounded")


@cache
def condition_kernels() -> Module:
    """The setter kernels, compiled once per process for the current device."""
    from grape.cuda.nvrtc import Module

    return Module(SOURCE, name="grape_conditions.cu")
