"""grape: practical CUDA graphs for dynamic deep neural networks, with a simulator twin.

The IR (:mod:`grape.ir`) and traces (:mod:`grape.trace`) are shared by two backends:
:mod:`grape.sim`, a SimPy model that predicts, and :mod:`grape.cuda`, which captures and replays
on a real GPU through cuda-python. :mod:`grape.passes` transforms graphs without a GPU, and
:mod:`grape.torch` is the PyTorch frontend.
"""

__version__ = "0.1.0"
