"""Device profiles: the constants of one GPU that the simulator costs work with.

``grape characterize`` measures them on a GPU (``grape.cuda.characterize``) and writes a JSON
profile; this module reads one anywhere, without a GPU, and names what each constant means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grape.errors import ProfileError
from grape.jsonio import check_schema, load_json

__all__ = ["CONSTANTS", "DEFAULT_PROFILE", "PROFILE_SCHEMA", "DeviceProfile", "load_profile",
           "other_device", "profile_for"]

PROFILE_SCHEMA = "grape.device"
# The profiles ship inside the package, so an installed grape predicts without a checkout; a
# trace is priced with its own GPU's where one is shipped (profile_for), else the H200's.
DEFAULT_PROFILE = Path(__file__).resolve().parent / "profiles" / "h200.json"
PROFILE_VERSION = 1

# name -> (path in the profile document, unit, meaning)
CONSTANTS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "eager_launch": (("eager_launch_us", "cuLaunchKernel", "median"), "us",
                     "host cost of one cuLaunchKernel from Python"),
    "torch_launch": (("eager_launch_us", "torch", "median"), "us",
                     "host cost of one kernel launch through PyTorch"),
    "graph_launch_fixed": (("graph_launch", "fit", "host_fixed_us"), "us",
                           "host cost of cuGraphLaunch, fixed part"),
    "graph_launch_per_node": (("graph_launch", "fit", "host_per_node_us"), "us",
                              "host cost of cuGraphLaunch per node"),
    "graph_gpu_per_node": (("graph_launch", "fit", "gpu_per_node_us"), "us",
                           "GPU time per empty kernel node in a graph"),
    "graph_kernel_gap": (("graph_gap", "gap_us"), "us",
                         "GPU front end's gap between consecutive graph kernels"),
    "profiler_per_event": (("profiler_overhead_us", "per_event"), "us",
                           "host time torch.profiler adds per recorded event (small BERT)"),
    "profiler_per_call": (("profiler_overhead_cuda_us", "per_event"), "us",
                          "host time a CUDA-activity-only profiler adds per API call"),
    "graph_node_overhead": (("graph_nodes", "fit", "per_node_us"), "us",
                            "GPU time a graph adds per node beyond its kernels' CUPTI time"),
    "profiler_graph_gap": (("graph_nodes", "profiler_gap_us"), "us",
                           "gap CUPTI itself shows between a graph's kernels"),
    "replay_fixed": (("torch_replay", "fit", "fixed_us"), "us",
                     "host cost of CUDAGraph.replay(), fixed part"),
    "replay_per_node": (("torch_replay", "fit", "per_node_us"), "us",
                        "host cost of CUDAGraph.replay() per node"),
    "instantiate_per_node": (("instantiate", "fit", "per_node_us"), "us",
                             "cuGraphInstantiate per node"),
    "upload_per_node": (("upload", "fit", "per_node_us"), "us", "cuGraphUpload per node"),
    "exec_update_per_node": (("exec_update", "fit", "per_node_us"), "us",
                             "cuGraphExecUpdate per node"),
    "set_params": (("kernel_node_set_params_us", "median"), "us",
                   "cuGraphExecKernelNodeSetParams, one node"),
    "while_per_iteration": (("conditional", "while_overhead_per_iteration_us"), "us",
                            "WHILE node overhead per iteration, beyond its body's kernels"),
    "if_overhead": (("conditional", "if", "overhead_us"), "us",
                    "IF node taken: GPU time beyond the same two kernels without it"),
    "copy_bandwidth": (("copy_d2d", "fit", "bandwidth_gb_s"), "GB/s",
                       "device-to-device copy, bytes read plus written"),
    "copy_latency": (("copy_d2d", "fit", "latency_us"), "us", "device-to-device copy latency"),
    "graph_copy_latency": (("graph_copy_nodes", "copy_fit", "latency_us"), "us",
                           "copy node in a graph, dispatch included: fixed part"),
    "graph_copy_us_per_byte": (("graph_copy_nodes", "copy_fit", "us_per_byte"), "us/B",
                               "copy node in a graph: per byte copied"),
    "graph_memset_latency": (("graph_copy_nodes", "memset_fit", "latency_us"), "us",
                             "memset node in a graph, dispatch included: fixed part"),
    "graph_memset_us_per_byte": (("graph_copy_nodes", "memset_fit", "us_per_byte"), "us/B",
                                 "memset node in a graph: per byte set"),
    "executable_bytes_per_node": (("executable_memory", "fit", "per_node_bytes"), "B",
                                  "device memory per instantiated node"),
}


@dataclass(frozen=True)
class DeviceProfile:
    path: str
    doc: dict[str, Any]

    @property
    def device(self) -> str:
        return self.doc["device"]

    def get(self, name: str) -> float:
        """A constant by its name in :data:`CONSTANTS`."""
        keys, _, _ = CONSTANTS[name]
        value: Any = self.doc
        for key in keys:
            if not isinstance(value, dict) or key not in value:
                raise ProfileError(f"{self.path}: expected {'.'.join(keys)} ({name}), found "
                                   f"no such entry")
            value = value[key]
        if type(value) not in (int, float) or not math.isfinite(value):
            raise ProfileError(f"{self.path}: expected {'.'.join(keys)} ({name}) a finite "
                               f"number, found {value!r:.60}")
        return float(value)


def profile_for(device: str | None, shipped: Path | None = None) -> DeviceProfile:
    """The profile shipped for ``device`` (a GPU's name as traces give it), else the default
    one: each of ``shipped`` (grape's ``profiles`` folder) names the GPU it was measured on."""
    folder = DEFAULT_PROFILE.parent if shipped is None else shipped
    if device:
        for path in sorted(folder.glob("*.json")):
            profile = load_profile(path)
            if profile.device == device:
                return profile
    return load_profile(DEFAULT_PROFILE)


def other_device(profile: DeviceProfile, device: str | None, what: str) -> str | None:
    """Why ``profile`` may misprice ``what`` (a trace) that ran on ``device``, or None where
    they name the same GPU or the trace names none. A profile's launch and per-node costs are
    its GPU's: on an H100 a graph's kernels stood 0.417 us apart under CUPTI where the H200
    profile puts CUPTI's own gap at 0.096, and the simulator took the rest for the machine."""
    if not device or device == profile.device:
        return None
    return (f"{what} ran on {device}, and the device profile {Path(profile.path).name} "
            f"describes {profile.device}: its launch and per-node costs are that GPU's "
            f"(`grape characterize --out P` on the trace's GPU, then --profile P)")


def load_profile(path: str | Path) -> DeviceProfile:
    """Read and check a device profile.

    Raises
    ------
    ProfileError
        Not a readable grape device profile.
    SchemaVersionError
        A profile version this grape does not read.
    """
    doc = load_json(path, ProfileError)
    return profile_from_json(doc, path)


def profile_from_json(doc: Any, path: str | Path) -> DeviceProfile:
    check_schema(doc, PROFILE_SCHEMA, PROFILE_VERSION, ProfileError, f"{path}: ")
    if not isinstance(doc.get("device"), str):
        raise ProfileError(f"{path}: expected a device name, found {doc.get('device')!r}")
    return DeviceProfile(str(path), doc)
