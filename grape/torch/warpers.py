"""Sampling's temperature and top-p read from the device, so that one executable serves them all.

``generate``'s ``TemperatureLogitsWarper`` and ``TopPLogitsWarper`` hold their value as a Python
float, which a captured step would freeze into its kernels' arguments: a call at another
temperature, or another ``top_p``, would need an executable of its own (a capture per request
where a server lets each request pick them, a capture per temperature where Whisper falls back
through rising ones). These warpers hold theirs in a 0-d device tensor that the call sets before
its launch (:meth:`set`), and compute what ``generate``'s compute, bit for bit:

- ``scores / t`` with a host scalar is, on a CUDA device, ``scores * (1 / t)`` with the
  reciprocal taken in float32 (PyTorch's ``div_true_kernel_cuda`` multiplies by it); on a CPU a
  float32 division by ``t`` as float32. ``DeviceTemperature`` holds that reciprocal, or ``t``.
  A temperature of 1, which ``generate`` skips, multiplies or divides by 1: the same bits.
- ``cumulative_probs <= 1 - top_p`` compares in float32 with ``1 - top_p`` rounded to it;
  ``DeviceTopP`` holds that float32 threshold. A ``top_p`` of 1 is not applied (as under
  ``generate``): whether top-p applies is part of the executable's key, its value is not.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["DeviceTemperature", "DeviceTopP"]


class DeviceTemperature:
    """``TemperatureLogitsWarper`` with its temperature on the device."""

    def __init__(self, temperature: float, device: torch.device) -> None:
        self.device = torch.device(device)
        self.value = torch.zeros((), dtype=torch.float32, device=self.device)
        self.set(temperature)

    def set(self, temperature: float) -> None:
        """This call's temperature (a kernel on the device's current stream; no sync)."""
        t = np.float32(temperature)
        self.value.fill_(float(np.float32(1) / t) if self.device.type == "cuda" else float(t))

    def __call__(self, input_ids: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return scores * self.value
        return scores / self.value


class DeviceTopP:
    """``TopPLogitsWarper`` (one token kept at least) with its ``top_p`` on the device."""

    def __init__(self, top_p: float, device: torch.device) -> None:
        self.threshold = torch.zeros((), dtype=torch.float32, device=device)
        self.set(top_p)

    def set(self, top_p: float) -> None:
        self.threshold.fill_(float(np.float32(1 - top_p)))

    def __call__(self, input_ids: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative_probs <= self.threshold
        remove[..., -1:] = False
        remove = remove.scatter(1, sorted_indices, remove)
        return scores.masked_fill(remove, -float("inf"))
