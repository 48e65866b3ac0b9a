from __future__ import annotations

from pathlib import Path

import pytest

TRACES = Path(__file__).resolve().parent.parent / "traces"
EAGER = TRACES / "gpt2_small_decode_b1_past64.eager.kineto.json.gz"
GRAPH = TRACES / "gpt2_small_decode_b1_past64.graph.kineto.json.gz"


@pytest.fixture(scope="session")
def eager_trace():
    from grape.trace import read_trace

    return read_trace(EAGER)


@pytest.fixture(scope="session")
def graph_trace():
    from grape.trace import read_trace

    return read_trace(GRAPH)
