"""grape.torch.capture's host-side choices that need no GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from grape.torch import capture  # noqa: E402


def test_every_capture_warms_up_on_one_stream_per_device(monkeypatch):
    # cuBLAS keeps a 33 MiB workspace for each stream it ran on until the process ends: a new
    # warm-up stream per capture held 1.1 GB under a 255-shape family on the H200.
    made, device = [], [0]
    monkeypatch.setattr(torch.cuda, "Stream", lambda: made.append(object()) or made[-1])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    monkeypatch.setattr(capture, "_WARMUP_STREAMS", {})
    first = capture._warmup_stream()
    assert all(capture._warmup_stream() is first for _ in range(300))
    device[0] = 1
    second = capture._warmup_stream()
    assert second is not first and capture._warmup_stream() is second
    assert len(made) == 2
