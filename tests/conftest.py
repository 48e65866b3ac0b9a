from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

# Derandomised: CI explores the same examples every run, so a red run is reproducible and a
# green one does not turn red by chance; raise max_examples locally to search further.
settings.register_profile("ci", max_examples=150, deadline=None, derandomize=True)
settings.load_profile("ci")

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
