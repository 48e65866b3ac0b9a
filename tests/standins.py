"""Stand-ins for the driver in CPU tests of grape.torch's executables."""

from __future__ import annotations

from cuda.bindings import driver

from grape.cuda.build import Update


class RecordingGraph:
    """Stands in for grape.cuda.build.Graph: counts the node updates it prepares; applied,
    each logs the node and the operation it sets."""

    def __init__(self, log: list, ir=None) -> None:
        self.log, self.ir, self.prepared = log, ir, 0

    def prepare(self, ops):
        self.prepared += len(ops)

        def record(handle, node, op):
            self.log.append((node, op))
            return (driver.CUresult.CUDA_SUCCESS,)
        return [Update(n, record, (n, op)) for n, op in ops.items()]

    def prepare_versions(self, versions):
        """Every version of one node, as the real graph prepares them (one update each)."""
        return [self.prepare({versions.node: versions.op(v)})[0] for v in range(len(versions))]
