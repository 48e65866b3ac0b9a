"""The CUDA backend: the only package that talks to the driver, through cuda-python.

It captures PyTorch work and raw NVRTC kernels into the IR, rebuilds and replays graphs from the
IR, applies compressed parameter deltas to instantiated executables, builds conditional nodes,
accounts for device memory and records traces. Every call goes through
:func:`grape.cuda.check.call`, which raises :class:`grape.errors.CudaError`.
"""

try:
    import cuda.bindings  # noqa: F401  (fail here, with advice, rather than deep inside)
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        "grape.cuda needs cuda-python's cuda-bindings: pip install 'grape[cuda]'") from e
