"""One small error hierarchy for everything grape reports to a user.

Every message says what was expected and what was found, so that a user can act on one line.
The command line prints ``str(error)`` and exits with status 2; nothing else escapes as a
traceback.
"""

from __future__ import annotations

__all__ = [
    "CudaError",
    "DanglingBufferError",
    "EmptyTraceError",
    "GrapeError",
    "GraphCycleError",
    "GraphError",
    "IterationError",
    "LaunchConfigError",
    "SchemaVersionError",
    "TraceError",
    "TraceFormatError",
    "UnknownNodeKindError",
]


class GrapeError(Exception):
    """Base class of every error grape raises on purpose."""


# --- the IR -------------------------------------------------------------------------------------


class GraphError(GrapeError):
    """A kernel graph that is not well formed."""


class GraphCycleError(GraphError):
    """Dependencies form a cycle; a CUDA graph must be acyclic."""


class DanglingBufferError(GraphError):
    """A node points into a buffer the buffer table does not hold, or outside its bytes."""


class UnknownNodeKindError(GraphError):
    """A node kind grape does not model."""


class LaunchConfigError(GraphError):
    """Grid, block, shared memory or argument layout that no CUDA device could launch."""


class SchemaVersionError(GrapeError):
    """A file written by a grape whose schema this grape does not read."""


# --- traces -------------------------------------------------------------------------------------


class TraceError(GrapeError):
    """A trace that cannot be read or understood."""


class TraceFormatError(TraceError):
    """Not JSON, truncated, not gzip, or not shaped like a Chrome trace."""


class EmptyTraceError(TraceError):
    """A trace with no GPU activity to analyse."""


class IterationError(TraceError):
    """The trace cannot be split into the iterations asked for."""


# --- the CUDA backend ---------------------------------------------------------------------------


class CudaError(GrapeError):
    """A driver or runtime call failed; the message names the call's purpose and the error code."""


class CaptureError(GrapeError):
    """A capture failed: the message names the offending operation and the line that issued it."""


class UnsupportedError(GrapeError):
    """Something grape does not model yet (a node type, a copy shape); never silently dropped."""


class ProfileError(GrapeError):
    """A device profile that is missing, malformed, or of another schema."""


class SimulationError(GrapeError):
    """The simulator lacks what a prediction needs (a kernel's duration, a conditional's
    choice): it says so rather than guess."""
