"""Mixture-of-experts layers whose work a graph can hold.

transformers runs a model's experts by the implementation its config names
(``config._experts_implementation``; ``transformers.integrations.moe``). Two of them read
values back to the host, which no capture holds:

- ``grouped_mm``, the default, is PyTorch's grouped GEMM. It runs on the device alone for
  bfloat16 on GPUs of compute capability 8.0 and up; in any other dtype PyTorch loops over the
  experts with their offsets copied to the host.
- ``eager``, the model's own loop, finds the experts a batch hit with ``nonzero``.

While ``grape.generate`` warms a model up and captures it, :func:`experts_on_device` runs such
experts by transformers' ``batched_mm`` instead: each token's chosen experts' weights are
gathered and multiplied in one batched product, on the device alone in every dtype, and the
top-k products are summed in float32. The tokens are ``generate``'s up to that rounding. When
it ends the model runs its experts as before (through the public snapshot and restore that
transformers gives, ``get_experts_implementation`` and ``set_experts_implementation``): the
caller's model is not left changed, and what runs eagerly later (a prompt run before each
launch) runs as ``generate`` runs it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

__all__ = ["experts_on_device", "reads_back"]

_LOG = logging.getLogger("grape")
_ON_DEVICE = "batched_mm"


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward transformers dispatches by ``_experts_implementation``: its
    ``use_experts_implementation`` decorator gives them these attributes and their config."""
    return [m for m in model.modules()
            if all(hasattr(m, a) for a in ("has_gate", "is_transposed", "is_concatenated"))
            and hasattr(getattr(m, "config", None), "_experts_implementation")]


def reads_back(implementation: str | None, dtype: torch.dtype,
               capability: tuple[int, int] | None) -> bool:
    """Whether experts run by ``implementation`` (None: transformers' default, ``grouped_mm``)
    over weights of ``dtype`` read values back from a GPU of compute ``capability`` (None: the
    weights are not on a GPU, and nothing is read back: no capture runs there, and the host
    loop keeps ``generate``'s arithmetic). Other implementations (``batched_mm``, kernels of
    other libraries) are taken to run on the device."""
    if capability is None or implementation not in (None, "grouped_mm", "eager"):
        return False
    return implementation == "eager" or dtype != torch.bfloat16 or capability < (8, 0)


def _capability(weight: torch.Tensor) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(weight.device) if weight.is_cuda else None


def _reading(model: torch.nn.Module) -> list[str]:
    """The implementations of ``model``'s experts that read back, one per module."""
    found = []
    for module in _experts(model):
        weight = next(module.parameters(), None)
        implementation = module.config._experts_implementation
        if weight is not None and reads_back(implementation, weight.dtype, _capability(weight)):
            found.append(f"{implementation or 'grouped_mm'} in {str(weight.dtype)[6:]}")
    return found


@contextlib.contextmanager
def experts_on_device(model: torch.nn.Module) -> Iterator[str | None]:
    """While inside: ``model``'s experts that would read back run by ``batched_mm``. Yields what
    they ran by before (e.g. "grouped_mm in float16"), or None where nothing changed: a model
    without such experts, or one whose experts transformers cannot switch (then its capture
    fails where they read back, and says so)."""
    reading = _reading(model)
    snapshot = None
    if reading and hasattr(model, "set_experts_implementation"):
        snapshot = model.get_experts_implementation()
        try:
            model.set_experts_implementation(_ON_DEVICE)
        except (ValueError, RuntimeError, ImportError) as e:
            _LOG.info("grape: %s's experts stay %s: transformers would not switch them (%s)",
                      type(model).__name__, reading[0], str(e).splitlines()[0])
            model.set_experts_implementation(snapshot)
            snapshot = None
        else:
            if _reading(model):  # some it could not reach: as before, whole
                model.set_experts_implementation(snapshot)
                snapshot = None
    if snapshot is None:
        yield None
        return
    _LOG.info("grape: %s's experts run by %s while grape captures: %s reads back to the host",
              type(model).__name__, _ON_DEVICE, reading[0])
    try:
        yield reading[0]
    finally:
        model.set_experts_implementation(snapshot)
