"""grape: practical CUDA graphs for dynamic deep neural networks, with a simulator twin.

The IR (:mod:`grape.ir`) and traces (:mod:`grape.trace`) are shared by two backends:
:mod:`grape.sim`, a SimPy model that predicts, and :mod:`grape.cuda`, which captures and replays
on a real GPU through cuda-python. :mod:`grape.passes` transforms graphs without a GPU, and
:mod:`grape.torch` is the PyTorch frontend.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``grape.generate`` and ``grape.graphed``, imported with PyTorch only when used."""
    if name == "generate":
        from grape.torch.api import generate

        return generate
    if name == "graphed":
        from grape.torch.graphed import graphed

        return graphed
    raise AttributeError(f"module 'grape' has no attribute {name!r}")
