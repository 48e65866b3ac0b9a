"""Mixture-of-experts layers whose work a graph can hold.

transformers runs a model's experts by the implementation its config names
(``config._experts_implementation``; ``transformers.integrations.moe``). Two of them read
values back to the host, which no capture holds:

- ``grouped_mm``, the default, is PyTorch's grouped GEMM. It runs on the device alone for
  bfloat16 on GPUs of compute capability 8.0 and up; in any other dtype PyTorch loops over the
  experts with their offsets copied to the host.
- ``eager``, the model's own loop, finds the experts a batch hit with ``nonzero``.

While grape warms such a model up and captures it, :func:`experts_on_device` runs its experts
by an implementation that reads nothing back, chosen per call by the call's size (:func:`way`):

- transformers' ``batched_mm`` where a call picks at most a third as many (token, expert)
  pairs as the layer has experts: each pair's expert weights are gathered and multiplied in
  one batched product (a decode step at batch 1 of many experts).
- :func:`dense_experts_forward` where more pairs are picked but the call has at most
  ``DENSE_TOKENS`` tokens: every token through every expert, weighted by the routing (zero
  where not picked). It reads each expert's weights once, and at so few rows a product's time
  is that of reading its weights, so the arithmetic for pairs not picked costs little. A
  decode step at batch 8, or five beams, runs so; on an H200 it ran an 8-expert layer's
  8-token call in 51 us where batched_mm took 160 and bf16's grouped GEMM 107. Its products
  are held for every expert at once: over ``DENSE_BYTES`` the tokens run in chunks.
- the model's own implementation otherwise (a long prompt): a captured prompt fails where it
  reads back, and ``grape.generate`` runs the prompt eagerly before each launch (its
  documented way).

Both sum the top-k products in float32 (the tokens are ``generate``'s up to that rounding).
When the context ends the model runs its experts as before (through the snapshot and restore
that transformers gives, ``get_experts_implementation`` and ``set_experts_implementation``):
the caller's model is not left changed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["DENSE_BYTES", "DENSE_TOKENS", "ON_DEVICE", "dense_experts_forward", "experts_on_device",
           "reads_back", "way"]

_LOG = logging.getLogger("grape")
# the implementation registered with transformers while inside experts_on_device (it runs
# batched_mm, dense or the given implementation, by way())
ON_DEVICE = "grape_on_device"
# The most tokens a call runs through every expert. A GPU's bf16 arithmetic runs several
# hundred operations in the time it reads a byte (about 300 on an H100): a product of few rows
# is paced by reading its weights, which dense reads once per expert, so the products of pairs
# not picked cost little time; a prompt of thousands of tokens would pay num_experts / top_k
# times its arithmetic at every launch. Measured in graphs (benchmarks/experts_ways.py), dense
# ran as fast as bf16's grouped GEMM up to 256 tokens in both layers tried on an H200 (8
# experts of 2048, top 2: 91 us against 146; 64 of 256, top 8: 166 against 165), and on an
# H100 up to 512 tokens of the first (169 against 188; at 1024, 313 against 236).
DENSE_TOKENS = 256
# The most bytes dense holds in products at once; more tokens run in chunks (at a DeepSeek-V3
# width, 256 experts of 2048 over hidden 7168, fp16 with fp32 router weights, a token's
# products take 14 MB: 37 tokens a chunk, and a 256-token call would otherwise hold 3.6 GB).
DENSE_BYTES = 512 << 20
# the implementation each switched config had (by id: configs need not hash), which calls over
# the bound run by
_GIVEN: dict[int, str | None] = {}


def _per_expert(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                transposed: bool) -> torch.Tensor:
    """Rows ``x`` [experts, tokens, in] through each expert's ``weight`` ([experts, out, in],
    or [experts, in, out] where ``transposed``): one batched product that reads each expert's
    weights where they lie, without gathering copies."""
    out = torch.bmm(x, weight if transposed else weight.transpose(1, 2))
    return out if bias is None else out + bias.unsqueeze(1)


def _dense_bytes_per_token(module: torch.nn.Module, hidden_states: torch.Tensor,
                           top_k_weights: torch.Tensor) -> int:
    """The bytes :func:`_dense` holds at once for each token it runs: the up projection and
    its gated half, the down projection and its weighted copy, for every expert."""
    def out_width(weight: torch.Tensor) -> int:
        return weight.shape[-1] if module.is_transposed else weight.shape[-2]

    up = out_width(module.gate_up_proj if module.has_gate else module.up_proj)
    gated = up // 2 if module.has_gate else up
    hidden = out_width(module.down_proj)
    size = hidden_states.element_size()
    weighting = torch.promote_types(hidden_states.dtype, top_k_weights.dtype).itemsize
    return module.num_experts * ((up + gated + hidden) * size + hidden * weighting)


def dense_experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor,
                          top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Every token through every expert, each product weighted by its routing weight (zero
    where the router did not pick it) in the dtype ``batched_mm`` weights it in, and summed in
    float32 as ``batched_mm`` sums. Fixed shapes and no read-back, in any dtype; it reads each
    expert's weights once, where ``batched_mm`` copies one expert's weights per (token,
    expert) pair, at ``num_experts / top_k`` times the arithmetic the picked pairs need.

    Every expert's products for every token are held at once: where they would pass
    ``DENSE_BYTES``, the tokens run in as many chunks as keep them under it (each chunk reads
    every expert's weights again; each token's sums are its own, whatever the chunks)."""
    rows = max(1, DENSE_BYTES // _dense_bytes_per_token(module, hidden_states, top_k_weights))
    if hidden_states.size(0) <= rows:
        return _dense(module, hidden_states, top_k_index, top_k_weights)
    chunks = zip(hidden_states.split(rows), top_k_index.split(rows), top_k_weights.split(rows),
                 strict=True)
    return torch.cat([_dense(module, *chunk) for chunk in chunks])


def _dense(module: torch.nn.Module, hidden_states: torch.Tensor,
           top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """:func:`dense_experts_forward` over tokens it holds at once."""
    experts = module.num_experts
    x = hidden_states.unsqueeze(0).expand(experts, -1, -1)
    if module.has_gate:
        up = _per_expert(x, module.gate_up_proj,
                         module.gate_up_proj_bias if module.has_bias else None,
                         module.is_transposed)
        up = module._apply_gate(up)
    else:
        up = module.act_fn(_per_expert(x, module.up_proj,
                                       module.up_proj_bias if module.has_bias else None,
                                       module.is_transposed))
    down = _per_expert(up, module.down_proj, module.down_proj_bias if module.has_bias else None,
                       module.is_transposed)
    # Each product is weighted in the dtype batched_mm weights it in (the products' and the
    # router weights' promoted), then summed in float32: the zeros of pairs not picked add
    # nothing, and 16-bit weights need no float32 copy of every expert's rows. (Index sentinels
    # of expert parallelism carry zero weights: clamped as batched_mm does.)
    weighting = torch.promote_types(down.dtype, top_k_weights.dtype)
    routing = torch.zeros(experts, hidden_states.size(0), dtype=weighting,
                          device=hidden_states.device).scatter_add_(
        0, top_k_index.clamp(0, experts - 1).t(), top_k_weights.to(weighting).t())
    return (down * routing.unsqueeze(-1)).sum(0, dtype=torch.float32).to(hidden_states.dtype)


def way(pairs: int, tokens: int, num_experts: int) -> str:
    """How grape's implementation runs a call of ``tokens`` rows that picks ``pairs`` (token,
    expert) pairs of ``num_experts``: "batched" (transformers' batched_mm) while it picks at
    most a third of the experts' count, "dense" for at most ``DENSE_TOKENS`` tokens, else
    "given" (the implementation the config had, which reads back: a long prompt, run eagerly
    by grape.generate before its launch).

    ``batched_mm`` moves each picked pair's expert weights three times (read and written by
    the gather, read by the product) where dense reads every expert's once: they cross near
    ``3 * pairs == num_experts``. Measured in graphs on an H200
    (``benchmarks/experts_ways.py``): of 8 experts (top 2), 1 token ran batched in 41 us
    against 46 dense, 2 tokens 55 against 51; of 64 (top 8), 2 tokens 43 against 51, 4 tokens
    59 against 51."""
    if 3 * pairs <= num_experts:
        return "batched"
    return "dense" if tokens <= DENSE_TOKENS else "given"


def _on_device(module: torch.nn.Module, hidden_states: torch.Tensor,
               top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The implementation grape registers: by :func:`way`."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, batched_mm_experts_forward

    chosen = way(top_k_index.numel(), hidden_states.size(0), module.num_experts)
    if chosen == "batched":
        return batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    if chosen == "dense":
        return dense_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    given = _GIVEN.get(id(module.config)) or "grouped_mm"
    # (eager: the class's own forward, which transformers' decorator wraps)
    own = ALL_EXPERTS_FUNCTIONS.get_interface(given, type(module).forward.__wrapped__)
    return own(module, hidden_states, top_k_index, top_k_weights)


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if ON_DEVICE not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(ON_DEVICE, _on_device)


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward transformers dispatches by ``_experts_implementation``: its
    ``use_experts_implementation`` decorator gives them these attributes and their config."""
    return [m for m in model.modules()
            if all(hasattr(m, a) for a in ("has_gate", "is_transposed", "is_concatenated"))
            and hasattr(getattr(m, "config", None), "_experts_implementation")]


def _switchable(implementation: str | None, capability: tuple[int, int] | None) -> bool:
    """Whether grape's implementation can stand in for ``implementation`` on a GPU of
    ``capability``: transformers' grouped GEMM and the eager loop (other libraries' kernels
    are left as they are)."""
    return capability is not None and implementation in (None, "grouped_mm", "eager")


def reads_back(implementation: str | None, dtype: torch.dtype,
               capability: tuple[int, int] | None) -> bool:
    """Whether experts run by ``implementation`` (None: transformers' default, ``grouped_mm``)
    over weights of ``dtype`` read values back from a GPU of compute ``capability`` (None: the
    weights are not on a GPU, and nothing is read back: no capture runs there, and the host
    loop keeps ``generate``'s arithmetic). Other implementations (``batched_mm``, kernels of
    other libraries) are taken to run on the device."""
    if not _switchable(implementation, capability):
        return False
    return implementation == "eager" or dtype != torch.bfloat16 or capability < (8, 0)


def _capability(weight: torch.Tensor) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(weight.device) if weight.is_cuda else None


def _reading(model: torch.nn.Module, every: bool = False) -> list[str]:
    """The implementations of ``model``'s experts to switch, one per module: those that read
    back, or with ``every`` all that grape's implementation can stand in for."""
    found = []
    for module in _experts(model):
        weight = next(module.parameters(), None)
        if weight is None:
            continue
        implementation, capability = module.config._experts_implementation, _capability(weight)
        if (_switchable(implementation, capability) if every
                else reads_back(implementation, weight.dtype, capability)):
            found.append(f"{implementation or 'grouped_mm'} in {str(weight.dtype)[6:]}")
    return found


def _configs(model: torch.nn.Module) -> list[Any]:
    return list({id(m.config): m.config for m in _experts(model)}.values())


@contextlib.contextmanager
def experts_on_device(model: torch.nn.Module, every: bool = False) -> Iterator[str | None]:
    """While inside: ``model``'s experts that would read back (with ``every``: every experts
    layer run by transformers' grouped GEMM or eager loop on a GPU, faster in graphs though it
    reads nothing back in bf16) run by grape's implementation (see the module). Yields what
    they ran by before (e.g. "grouped_mm in float16"), or None where nothing changed: a model
    without such experts, or one whose experts transformers cannot switch (then its capture
    fails where they read back, and says so)."""
    reading = _reading(model, every)
    if not reading or not hasattr(model, "set_experts_implementation"):
        yield None
        return
    _register()
    snapshot = model.get_experts_implementation()
    given = {id(c): c._experts_implementation for c in _configs(model)}
    try:
        model.set_experts_implementation(ON_DEVICE)
        switched = not _reading(model, every) and all(
            c._experts_implementation == ON_DEVICE for c in _configs(model))
    except (ValueError, RuntimeError, ImportError, KeyError) as e:
        _LOG.info("grape: %s's experts stay %s: transformers would not switch them (%s)",
                  type(model).__name__, reading[0], str(e).splitlines()[0])
        switched = False
    if not switched:  # (some it could not reach: all as before)
        model.set_experts_implementation(snapshot)
        yield None
        return
    _GIVEN.update(given)
    _LOG.info("grape: %s's experts run by batched_mm or densely in calls of few tokens while "
              "grape captures, not by %s", type(model).__name__, reading[0])
    try:
        yield reading[0]
    finally:
        for key in given:
            _GIVEN.pop(key, None)
        model.set_experts_implementation(snapshot)
