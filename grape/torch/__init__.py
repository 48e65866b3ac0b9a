"""The PyTorch frontend: graphed callables over families of shapes, alias prediction by code
position, predication helpers (``cond``, ``while_loop``) and Hugging Face generation.

The only package besides tests and benchmarks that imports ``torch``.
"""
