"""grape.torch.cache_length.ranged_arange's cost on an eager forward, on the CPU: a GPT-2-small
shaped model (random weights) over a 32-token prompt, with the mode and without, interleaved 15
times; the medians, their ratio, and the torch calls a forward makes (each one Python call more
under the mode).

Run: python benchmarks/ranged_arange_cost.py
"""

import statistics
import time
import warnings

import torch
import transformers
from torch.overrides import TorchFunctionMode

from grape.torch.cache_length import ranged_arange


class Count(TorchFunctionMode):
    n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        Count.n += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
    ids = torch.randint(0, 50000, (1, 32))
    with torch.no_grad():
        with Count():
            model(ids)
        times: dict[str, list[float]] = {"with": [], "without": []}
        for _ in range(15):
            for way in ("with", "without"):
                began = time.perf_counter()
                if way == "with":
                    with ranged_arange():
                        model(ids)
                else:
                    model(ids)
                times[way].append(time.perf_counter() - began)
    w, wo = statistics.median(times["with"]), statistics.median(times["without"])
    print(f"torch calls a forward: {Count.n}; median ms with {w * 1e3:.2f}, without "
          f"{wo * 1e3:.2f}, ratio {w / wo:.3f}, per call {(w - wo) / Count.n * 1e6:.2f} us")


if __name__ == "__main__":
    main()
