"""Tensor parallelism for Hugging Face models, by the model's own plan, for graphs and loops.

:func:`shard` splits a model over the ranks of a ``torch.distributed`` process group the way
its config says (``base_model_tp_plan``, which transformers declares for Llama, Qwen2, Mistral
and others: ``"colwise"`` layers keep a slice of their output features, ``"rowwise"`` layers a
slice of their input features and sum their partial outputs with an all-reduce). Attention
then runs a slice of the heads per rank, the MLP a slice of its intermediate columns, and each
layer ends its attention and its MLP in one all-reduce. Embeddings, norms and the LM head stay
whole on every rank, so every rank computes the same logits, bit for bit (NCCL hands every rank
the same sum), and chooses the same tokens.

The all-reduces are ordinary collectives on the current stream, so a captured step holds
NCCL's kernels and a device loop runs them every iteration, with no host in between. What
every rank must agree on is agreed on the device: ``grape.torch.decoding``'s loop condition
is all-reduced (a maximum) at the end of every step, so every rank leaves the loop on the same
token even if their conditions differed, and a rank never waits alone in a collective the
others left. Decisions taken once on the host (whether a capture worked) are agreed by
:func:`agree` before anyone acts on them.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import torch

from grape.errors import GrapeError

__all__ = ["agree", "group_of", "shard"]

_GROUPS: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


def _dist() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise GrapeError("expected torch.distributed to be initialised (torchrun and "
                         "init_process_group) to shard a model, found it is not")
    return dist


def _pattern(key: str) -> re.Pattern[str]:
    """A plan key (``layers.*.mlp.up_proj``) as a match on module names: ``*`` is one name."""
    return re.compile("^" + r"[^.]+".join(map(re.escape, key.split("*"))) + "$")


def group_of(model: torch.nn.Module) -> Any:
    """The process group :func:`shard` split ``model`` over, or None."""
    return _GROUPS.get(model)


def shard(model: torch.nn.Module, group: Any = None,
          plan: dict[str, str] | None = None) -> torch.nn.Module:
    """Split ``model`` in place over the ranks of ``group`` (default: the world), by ``plan``
    (default: the config's ``base_model_tp_plan``), keys relative to the base model
    (``model.base_model``), values ``"colwise"`` or ``"rowwise"``. Every rank must call it, on
    the same model, built from the same weights. Returns ``model``.

    Raises
    ------
    GrapeError
        torch.distributed not initialised; a model already sharded; no plan, a plan naming no
        module, a style other than colwise and rowwise, or a planned module that is not a
        linear layer; head counts or features that the ranks do not divide.
    """
    dist = _dist()
    if model in _GROUPS:
        raise GrapeError(f"expected a model not yet sharded, found {type(model).__name__} "
                         f"already split over {dist.get_world_size(_GROUPS[model])} ranks")
    group = group if group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = plan if plan is not None else getattr(model.config, "base_model_tp_plan", None)
    if not plan:
        raise GrapeError(f"expected a tensor-parallel plan (the config's base_model_tp_plan, "
                         f"or plan=), found none for {type(model).__name__}")
    for what in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(model.config, what, None)
        if heads is not None and heads % world:
            raise GrapeError(f"expected {what} ({heads}) divisible by the {world} ranks, "
                             f"found a remainder of {heads % world}")
    patterns = [(key, _pattern(key), style) for key, style in plan.items()]
    planned = []
    for name, module in model.base_model.named_modules():
        style = next((s for _, p, s in patterns if p.match(name)), None)
        if style is None:
            continue
        if style not in ("colwise", "rowwise"):
            raise GrapeError(f"expected plan styles 'colwise' or 'rowwise', found {style!r} "
                             f"for {name}")
        if not isinstance(module, torch.nn.Linear):
            raise GrapeError(f"expected a linear layer at {name} ({style}), found "
                             f"{type(module).__name__}")
        planned.append((name, module, style))
    if not planned:
        raise GrapeError(f"expected the plan to name modules of {type(model).__name__}, found "
                         f"none matching {sorted(plan)[:3]}")
    for name, module, style in planned:
        _split(name, module, style, rank, world, group)
    _GROUPS[model] = group
    return model


def _split(name: str, linear: torch.nn.Linear, style: str, rank: int, world: int,
           group: Any) -> None:
    dim = 0 if style == "colwise" else 1  # weight is (out_features, in_features)
    size = linear.weight.shape[dim]
    if size % world:
        raise GrapeError(f"expected {name}'s {'output' if dim == 0 else 'input'} features "
                         f"({size}) divisible by the {world} ranks, found a remainder of "
                         f"{size % world}")
    part = size // world
    with torch.no_grad():
        weight = linear.weight.narrow(dim, rank * part, part).clone()
        linear.weight = torch.nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
        if dim == 0:
            linear.out_features = part
            if linear.bias is not None:
                linear.bias = torch.nn.Parameter(linear.bias.narrow(0, rank * part, part)
                                                 .clone())
        else:
            linear.in_features = part
    if dim == 1:
        # The bias is added once, after the sum (every rank adding it would add it world
        # times); the partial products are summed in place, on the current stream.
        bias, linear.bias = linear.bias, None
        linear.register_forward_hook(_summed(group, bias))


def _summed(group: Any, bias: torch.nn.Parameter | None) -> Any:
    import torch.distributed as dist

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out, group=group)
        return out if bias is None else out + bias
    return hook


def agree(ok: bool, group: Any, device: torch.device | str | None = None) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (one small all-reduce and one read-back:
    for decisions taken once, such as whether a capture worked, so that every rank falls back
    together rather than one waiting in a collective the others never join)."""
    import torch.distributed as dist

    if device is None:
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
