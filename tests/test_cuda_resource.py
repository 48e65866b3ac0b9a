"""Resources release their handle once, whichever way they go, and are counted while open."""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed")

from grape.cuda.resource import Resource, open_resources


class Handle(Resource):
    def __init__(self, log: list, handle: int) -> None:
        self._own(handle, log.append)


def test_each_handle_is_released_once_and_counted_while_open():
    log: list = []
    before = open_resources().get("Handle", 0)
    a, b, c = Handle(log, 1), Handle(log, 2), Handle(log, 3)
    assert open_resources()["Handle"] == before + 3
    a.close()
    a.close()  # a second close does nothing
    with b:
        pass
    del c  # collected: the finaliser releases it
    gc.collect()
    assert log == [1, 2, 3]
    assert a.closed and b.closed
    assert open_resources().get("Handle", 0) == before
