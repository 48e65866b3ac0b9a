"""Where a Hugging Face model's own code runs on grape's fixed-shape state, and fails there.

grape hands a model a static cache, a full-length mask and positions as tensors. An
architecture whose forward cannot take them (a cache of its own kind, as MiniMax and xLSTM
keep; a mask function its transformers version cannot call) raises inside its own code: that
is a reason to run ``model.generate`` instead, said in one line with the place that raised,
not a traceback. ``grape.generate`` refuses so where it first runs the model, before capture,
and the host loop (``grape.torch.host_loop``) where it runs the same check (``check_written``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from grape.errors import GrapeError
from grape.torch.options import NotGraphable

__all__ = ["COMPILE_ERRORS", "model_code"]

try:  # what a failing torch.compile raises (Dynamo's and Inductor's errors)
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError

    COMPILE_ERRORS: tuple[type[Exception], ...] = (TorchDynamoException, InductorError)
except ImportError:  # pragma: no cover - torch without Inductor
    COMPILE_ERRORS = ()
try:  # a function compiled with fullgraph=True for more shapes than Dynamo's recompile_limit
    # raises this, which is not a TorchDynamoException
    from torch._dynamo.exc import FailOnRecompileLimitHit

    COMPILE_ERRORS += (FailOnRecompileLimitHit,)
except ImportError:  # pragma: no cover - older torch
    pass


@contextlib.contextmanager
def model_code(model: torch.nn.Module, refusal: type[NotGraphable] = NotGraphable,
               state: str = "grape's static cache and fixed-shape inputs") -> Iterator[None]:
    """Runs the model's own code, eagerly: what it raises becomes ``refusal``, naming the
    model, the state it failed on, the error and the line that raised. grape's own refusals,
    and compilation's errors (reported as such), pass through."""
    try:
        yield
    except (GrapeError, NotGraphable, *COMPILE_ERRORS):
        raise
    except Exception as e:
        # (imported here: the culprit's frames filter is the capture module's, and the host
        # loop, which runs anywhere, need not load the CUDA backend to name a line)
        from grape.torch.capture import culprit

        message = (str(e).strip().splitlines() or [""])[0]
        raise refusal(f"{type(model).__name__} failed on {state}: {type(e).__name__}: "
                      f"{message} (at {culprit(e)})") from None
