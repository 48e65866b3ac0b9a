"""Whether a ``torch.compile``d module runs its compiled code under a Python dispatch mode
(CPU): the operations a counting ``TorchDispatchMode`` sees in one call of a compiled
``Linear -> GELU -> Linear``, against an eager call's.

Written for why ``grape.generate(compile=True, concurrent=True)`` captured more nodes than the
compiled chain (on an H100, GPT-2 small 307 against 151; a 2-layer Llama 133 against 59,
``benchmarks/results/gpu_h100_f926a52/compile_default.log``): the concurrency pass notes each
operation with such a mode during the capture. With torch 2.13.0+cpu the compiled call under
the mode shows the eager operations (``t``, ``addmm``, ``gelu``: an Inductor kernel would have
fused the GELU out of the dispatcher's sight), and Dynamo counts no new graph: a frame whose
guards fail under a non-infrastructure dispatch mode is run eagerly, not compiled
(``torch/_dynamo/convert_frame.py``: "non-infra torch dispatch mode present, this is not
supported today in torch.compile"). So the noted step ran the model's own kernels, through the
decoder's paths for a compiled step, which leave grape's per-step rewrites of the eager step
off.

python benchmarks/compiled_under_dispatch_mode.py
"""

import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 16)).eval()
    compiled = torch.compile(model, dynamic=False)
    x = torch.randn(2, 16)
    with torch.no_grad():
        compiled(x)  # compiles
        graphs = counters["stats"]["unique_graphs"]
        under, eager = Count(), Count()
        with under:
            compiled(x)
        with eager:
            model(x)
    print(f"torch {torch.__version__}")
    print(f"compiled call under the mode: {len(under.names)} operations {under.names}")
    print(f"eager call under the mode:    {len(eager.names)} operations {eager.names}")
    print(f"graphs Dynamo compiled: {graphs} before the moded call, "
          f"{counters['stats']['unique_graphs']} after")


if __name__ == "__main__":
    main()
