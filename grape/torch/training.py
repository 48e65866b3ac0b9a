"""Graphed training steps: forward, backward and optimizer step as one launch per batch, over
a family of input lengths.

A training step has three things a plain capture cannot hold: state that must stay put
(parameters, gradients, optimizer state, the loss scale), a decision the host usually makes
(skip the update when a mixed-precision step overflowed: ``GradScaler`` reads ``found_inf``
back), and inputs whose length changes from batch to batch. Here:

- every tensor the step updates is allocated before capture and updated in place: gradients
  exist (zeros) before the first capture and are zeroed at the end of each step, not set to
  None; the optimizer's state comes from real steps run eagerly first, as many as it takes for
  the optimizer to have stepped once (a mixed-precision step skipped on overflow creates no
  state, and state first created inside a capture would be re-created, zeroed, at every
  launch); the step count, the learning rate (where the optimizer takes a tensor) and the loss
  scale live on the device;
- :class:`LossScaler` is ``GradScaler``'s dynamic loss scaling with the same kernels
  (``_amp_foreach_non_finite_check_and_unscale_``, ``_amp_update_scale_``), so its scale and
  what it skips are bitwise what ``GradScaler`` does, but its skip-on-overflow is a
  ``grape.torch.control.predicate`` region: eagerly one read-back, under capture a CUDA IF node
  that the GPU decides on each replay (no host sync, for any optimizer, capturable or not);
- the batch is copied (non-blocking, from the loader's pinned memory) into a static input
  buffer of the largest length, and the step at length ``n`` reads its first ``n`` columns: a
  family (``grape.torch.family``) with one executable per topology, every length's activations
  in the memory of the largest; or, with ``inputs_by="alias"``, the graphs read each batch where
  it lies (``grape.graphed``: re-pointed when it moves, nothing copied).

:class:`GraphedTraining` puts these together. A batch longer than the family's largest length
runs eagerly with a warning (never truncated); a step that cannot be captured (a host sync in
a custom autograd function, a non-capturable optimizer) is named in one warning and training
goes on eagerly. A step that draws random numbers on the device (dropout) gets fresh ones at
every launch from ``grape.torch.rng.GraphRandom`` (PyTorch's replay prologue, for grape's
launches), or, where that cannot be set up, is trained eagerly with a warning: never with one
step's dropout masks repeated.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grape.errors import CaptureError, GrapeError
from grape.torch.control import predicate
from grape.torch.hfmasks import no_padding_shortcut

__all__ = ["GraphedTraining", "LossScaler", "TrainingStats", "pad_batch"]


class LossScaler:
    """Dynamic loss scaling as ``torch.amp.GradScaler`` does it, with no host sync.

    Use in a step as ``GradScaler`` is used: ``scaler.scale(loss).backward()``,
    ``scaler.unscale_(optimizer)`` (before clipping; :meth:`step` does it otherwise),
    ``scaler.step(optimizer)``, ``scaler.update()``. The scale starts at ``init_scale``, halves
    (``backoff_factor``) on a step whose gradients hold an inf or NaN, which is skipped, and
    doubles (``growth_factor``) after ``growth_interval`` clean steps in a row.
    """

    def __init__(self, device: torch.device | str = "cuda", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1
                and init_scale > 0):
            raise GrapeError(f"expected growth_factor > 1, 0 < backoff_factor < 1, "
                             f"growth_interval >= 1 and init_scale > 0, found "
                             f"{growth_factor}, {backoff_factor}, {growth_interval}, "
                             f"{init_scale}")
        device = torch.device(device)
        self.scale_ = torch.full((), init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._unscaled = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale in place and note in ``found_inf`` whether any
        holds an inf or NaN (grouped by dtype, as ``GradScaler`` groups them)."""
        if self._unscaled:
            raise GrapeError("expected unscale_ once per step, found a second call before "
                             "step()")
        self.found_inf.zero_()
        inv_scale = self.scale_.double().reciprocal().float()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        with torch.no_grad():
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf,
                                                                 inv_scale)
        self._unscaled = True

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` unless the gradients overflowed: a predicated region (eagerly
        one read-back; under capture an IF node)."""
        if not self._unscaled:
            self.unscale_(optimizer)
        with predicate(self.found_inf == 0) as clean:
            if clean:
                optimizer.step()
        self._unscaled = False

    def update(self) -> None:
        torch._amp_update_scale_(self.scale_, self.growth_tracker, self.found_inf,
                                 self.growth_factor, self.backoff_factor,
                                 self.growth_interval)

    def get_scale(self) -> float:
        return float(self.scale_)  # a read-back: for reports, never inside a step


@dataclass
class TrainingStats:
    steps: int = 0
    graphed_steps: int = 0
    eager_steps: int = 0  # warm-up, lengths outside the family, or no graphs at all
    capture_s: float = 0.0
    optimizer_steps: int = 0  # eager steps in which the optimizer stepped (not skipped)
    lengths_captured: int = 0
    executables: int = 0
    fallback: str | None = None  # why training runs eagerly, where it does


LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class GraphedTraining:
    """Training steps over variable input lengths as graph launches (see the module).

    ``loss_fn(model, inputs, targets)`` returns the loss of a batch (for a Hugging Face CTC
    model: ``model(inputs, labels=targets).loss``). ``inputs`` is (batch, length, ...) and
    varies in ``length``; ``targets`` has one fixed shape (pad labels to ``target_shape``, as
    ``-100`` for a CTC model). ``lengths``: the input lengths to capture (the family); a batch
    of another length runs eagerly, with a warning once per length (with ``inputs_by="alias"``
    it is captured on first use instead). ``amp``: autocast's dtype
    (None: no autocast); ``scaler``: a :class:`LossScaler` (fp16 needs one). ``clip_norm``:
    gradients clipped to this global norm, on the device. ``schedule(step)``, where the
    optimizer's learning rate is a tensor: the rate for the step count (a device tensor), set
    in place each step. ``graphs=False`` runs the very same step eagerly: the reference the
    graphed one is held to.
    """

    model: torch.nn.Module
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer
    lengths: Sequence[int]
    input_shape: tuple[int, ...]  # one batch's inputs at the largest length
    target_shape: tuple[int, ...]
    input_dtype: torch.dtype = torch.float32
    target_dtype: torch.dtype = torch.long
    amp: torch.dtype | None = None
    scaler: LossScaler | None = None
    clip_norm: float | None = None
    schedule: Callable[[torch.Tensor], torch.Tensor] | None = None
    graphs: bool = True
    derive_every: int | None = None  # capture one length in N, derive the rest (issue 15)
    # "copy": each batch copied into the static input buffer the family reads; "alias": the
    # graphs re-pointed at each batch where it lies (grape.graphed), nothing copied.
    inputs_by: str = "copy"
    progress: Callable[[str], None] | None = None  # lines on a capture's progress (None:
    # the grape logger, as capture_family's default)
    stats: TrainingStats = field(default_factory=TrainingStats)

    def __post_init__(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise GrapeError("expected a model with trainable parameters, found none")
        self.device = params[0].device
        if self.graphs and self.device.type != "cuda":
            raise GrapeError(f"expected a model on a CUDA device to graph its training, found "
                             f"one on {self.device} (graphs=False trains eagerly anywhere)")
        lengths = sorted(set(self.lengths), reverse=True)
        if not lengths or lengths[-1] < 1 or lengths[0] != self.input_shape[1]:
            raise GrapeError(f"expected positive lengths to capture, the largest equal to "
                             f"input_shape[1] ({self.input_shape[1]}), found "
                             f"{len(lengths)} lengths, largest "
                             f"{lengths[0] if lengths else None}")
        if self.schedule is not None and not all(
                isinstance(g["lr"], torch.Tensor) for g in self.optimizer.param_groups):
            raise GrapeError("expected an optimizer whose learning rate is a tensor (lr="
                             "torch.tensor(...), capturable=True) to schedule it on the "
                             "device, found a float")
        if self.inputs_by not in ("copy", "alias"):
            raise GrapeError(f"expected inputs_by 'copy' or 'alias', found {self.inputs_by!r}")
        if self.amp == torch.float16 and self.scaler is None:
            raise GrapeError("expected a LossScaler with fp16 autocast (gradients underflow "
                             "without one), found none")
        self.lengths = lengths
        self.inputs = torch.zeros(self.input_shape, dtype=self.input_dtype, device=self.device)
        self.targets = torch.zeros(self.target_shape, dtype=self.target_dtype,
                                   device=self.device)
        self.loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self.step_count = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in params:  # gradients that stay put: updated in place by every step
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._params = params
        self._family: Any = None  # inputs_by="copy": a grape.torch.family.Family
        self._graphed: Any = None  # inputs_by="alias": a grape.torch.graphed.Graphed
        self._warned: set[int] = set()
        self._random_draws = 0  # philox offset an eager step advanced the generator by
        self._random: Any = None  # a grape.torch.rng.GraphRandom where the step draws
        # Optimizers create their state (Adam's moments, SGD's momentum) on their first step.
        # Until one has run for real, a capture would hold that creation, zeros written over the
        # state at every launch; so steps stay eager until then (a step the loss scaler skips
        # does not count).
        self._stepped_hook = self.optimizer.register_step_post_hook(self._count_optimizer_step)

    def _count_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # (torch's CPU builds have no capture to ask about)
        if self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            self.stats.optimizer_steps += 1

    @property
    def ready_to_capture(self) -> bool:
        """Whether a step has run eagerly in which the optimizer stepped: its lazily created
        state exists, so a capture only updates it."""
        return self.stats.optimizer_steps > 0

    # The step itself, on the static buffers: the one code path, eager or captured.
    def step_at(self, length: int) -> None:
        """The step on the static buffers' first ``length`` columns, issued now: run eagerly,
        or recorded by a capture under way (the family's, or a caller's own graph)."""
        inputs = self.inputs[:, :length]
        # No autocast weight cache: a cast cached in one step would be a captured constant.
        autocast = (torch.autocast(self.device.type, dtype=self.amp, cache_enabled=False)
                    if self.amp is not None else contextlib.nullcontext())
        # Under a capture, Hugging Face's models would build an all-true attention mask where
        # eagerly they pass none, and change SDPA's kernels (grape.torch.hfmasks).
        with autocast, no_padding_shortcut():
            loss = self.loss_fn(self.model, inputs, self.targets)
        self.step_count.add_(1)
        if self.schedule is not None:
            rate = self.schedule(self.step_count)
            for group in self.optimizer.param_groups:
                group["lr"].copy_(rate)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
        else:
            loss.backward()
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._params, self.clip_norm, foreach=True)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self.loss.copy_(loss.detach())

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One training step on a batch; returns the loss (a device tensor, rewritten by the
        next step: clone it to keep it, ``.item()`` it to read it)."""
        length = self._check(inputs, targets)
        if length > self.lengths[0]:
            self._warn(length, f"a batch of length {length} is longer than the family's "
                               f"largest ({self.lengths[0]}): it runs eagerly, on its own "
                               f"tensors")
            self._eager_on(inputs, targets)
            return self.loss
        if self.graphs and self.stats.fallback is None and self.ready_to_capture:
            self.capture()  # once: the optimizer's state exists after its first real step
        if self._graphed is not None:
            self._fresh_random()
            try:
                self._graphed(inputs.to(self.device, non_blocking=True),
                              targets.to(self.device, non_blocking=True))
            except (CaptureError, GrapeError) as e:  # a length captured on first use
                self._give_up(e)
                self._eager_on(inputs, targets)
                return self.loss
            self.stats.graphed_steps += 1
            self.stats.steps += 1
            self.stats.executables = self._graphed.executables
            return self.loss
        self.inputs[:, :length].copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        family = self._family
        if family is not None and length in family.group_of:
            self._fresh_random()
            family.run(length)
            self.stats.graphed_steps += 1
        else:
            if family is not None:
                self._warn(length, f"length {length} is not in the family: it runs eagerly")
            drawn = self._random_offset()
            self.step_at(length)
            self.stats.eager_steps += 1
            self._random_draws = max(self._random_draws, self._random_offset() - drawn)
        self.stats.steps += 1
        return self.loss

    def _fresh_random(self) -> None:
        if self._random is not None:
            self._random.before_launch(torch.cuda.current_stream(self.device).cuda_stream)

    def _random_offset(self) -> int:
        """Where the device's random generator stands (philox offset): a step that moves it
        draws random numbers (dropout), which a relaunched graph would draw again, the same."""
        if self.device.type != "cuda":
            return 0
        return torch.cuda.default_generators[self.device.index or 0].get_offset()

    def _check(self, inputs: torch.Tensor, targets: torch.Tensor) -> int:
        if inputs.dim() != len(self.input_shape) or inputs.shape[0] != self.input_shape[0] \
                or tuple(inputs.shape[2:]) != tuple(self.input_shape[2:]):
            raise GrapeError(f"expected inputs of shape ({self.input_shape[0]}, length, "
                             f"{', '.join(map(str, self.input_shape[2:]))}), found "
                             f"{tuple(inputs.shape)}".replace(", )", ")"))
        if tuple(targets.shape) != tuple(self.target_shape):
            raise GrapeError(f"expected targets of shape {tuple(self.target_shape)} (pad "
                             f"them), found {tuple(targets.shape)}")
        if inputs.dtype != self.input_dtype or targets.dtype != self.target_dtype:
            raise GrapeError(f"expected inputs of {self.input_dtype} and targets of "
                             f"{self.target_dtype}, found {inputs.dtype} and {targets.dtype}")
        return inputs.shape[1]

    def _warn(self, length: int, message: str) -> None:
        if length not in self._warned:
            self._warned.add(length)
            warnings.warn(message, stacklevel=3)

    def _step_on(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """The step on the caller's own tensors, issued now (eagerly or into a capture)."""
        saved = self.inputs, self.targets
        self.inputs, self.targets = inputs, targets
        try:
            self.step_at(inputs.shape[1])
        finally:
            self.inputs, self.targets = saved

    def _eager_on(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """A step on the caller's own tensors (a batch the static buffers cannot hold)."""
        self._step_on(inputs.to(self.device), targets.to(self.device))
        self.stats.eager_steps += 1
        self.stats.steps += 1

    def _give_up(self, error: Exception) -> None:
        self.stats.fallback = str(error).splitlines()[0]
        warnings.warn(f"grape trains eagerly: the step cannot be graphed: "
                      f"{self.stats.fallback}", stacklevel=3)
        self.close()

    def capture(self) -> None:
        """Capture the graphs now (the second step does otherwise): every length of the
        family, largest first. A step must have run first, eagerly, so that the optimizer's
        state exists. A step that cannot be captured leaves training eager, with one warning
        naming why."""
        from grape.torch.family import capture_family
        from grape.torch.graphed import graphed

        if not self.graphs or self._family is not None or self._graphed is not None \
                or self.stats.fallback is not None:
            return
        if not self.ready_to_capture:
            raise GrapeError(f"expected a step run eagerly in which the optimizer stepped "
                             f"before capturing (its first step creates its state), found "
                             f"{self.stats.steps} steps, none of which stepped it (a step "
                             f"the loss scaler skips on overflow does not)")
        if self._random_draws:
            # PyTorch's own replays move the generator on and hand each graph a fresh offset;
            # grape's launches get the same from GraphRandom, or training is not graphed: a
            # step that repeated its dropout masks every time would train wrongly.
            from grape.torch.rng import GraphRandom

            try:
                self._random = GraphRandom.probe(self.device)
            except (CaptureError, GrapeError) as e:
                self._give_up(GrapeError(
                    f"expected to give graphed steps fresh random numbers (the step draws: the "
                    f"CUDA generator moved by {self._random_draws} in an eager step), found "
                    f"{str(e).splitlines()[0]}"))
                return
        began = time.perf_counter()
        params = dict(self.model.named_parameters())
        kept = {p: dict(st) for p, st in self.optimizer.state.items()}
        try:
            # No warm-up per length: it would train on whatever the buffers hold. The real
            # steps already run initialised what is lazy (optimizer state, library handles).
            if self.inputs_by == "copy":
                self._family = capture_family(self.step_at, self.lengths, params=params,
                                              derive_every=self.derive_every, warmup=0,
                                              progress=self.progress)
                self.stats.lengths_captured = len(self._family.group_of)
                self.stats.executables = len(self._family.groups)
            else:
                self._graphed = graphed(self._step_on, params=params, warmup=0)
                for n in self.lengths:  # captured on stand-ins; each call re-points them
                    self._graphed.prepare(self.inputs[:, :n].clone(), self.targets.clone())
                self.stats.lengths_captured = self._graphed.signatures
                self.stats.executables = self._graphed.executables
        except (CaptureError, GrapeError) as e:
            self._restore_state(kept)
            self._give_up(e)
            return
        if _state_tensors(self.optimizer.state) != _state_tensors(kept):
            # A parameter the optimizer had not stepped yet (no gradient in the eager steps):
            # its state was created in the capture, and every launch would zero it again. The
            # eager steps from here on create it afresh.
            self._restore_state(kept)
            self._give_up(GrapeError(
                "expected the optimizer's state to exist before capture, found state created "
                "inside it (a parameter that had no gradient in the eager steps): each launch "
                "would reset it"))
            return
        self.stats.capture_s = time.perf_counter() - began

    def _restore_state(self, kept: dict[Any, dict[str, Any]]) -> None:
        """The optimizer's state as it was before a capture: entries a capture created hold
        tensors that were never written (a capture runs nothing)."""
        state = self.optimizer.state
        for p in [p for p in state if p not in kept]:
            del state[p]
        for p, st in kept.items():
            state[p] = st

    def close(self) -> None:
        if self._family is not None:
            self._family.close()
            self._family = None
        if self._graphed is not None:
            self._graphed.close()
            self._graphed = None


def _state_tensors(state: Mapping[Any, Mapping[str, Any]]) -> dict[int, tuple]:
    """Which tensors hold an optimizer's state, per parameter (by identity; other values, such
    as a host step count, by key only)."""
    return {id(p): tuple(sorted((k, id(v) if isinstance(v, torch.Tensor) else None)
                                for k, v in st.items()))
            for p, st in state.items()}


def pad_batch(samples: Iterable[torch.Tensor], length: int, value: float = 0.0
              ) -> torch.Tensor:
    """Samples of varying length (first dimension) padded at the end to ``length``, stacked;
    a sample longer than ``length`` is refused, never truncated."""
    samples = list(samples)
    longest = max(s.shape[0] for s in samples)
    if longest > length:
        raise GrapeError(f"expected samples of at most {length} along their first dimension, "
                         f"found one of {longest}")
    out = samples[0].new_full((len(samples), length, *samples[0].shape[1:]), value)
    for i, s in enumerate(samples):
        out[i, :s.shape[0]] = s
    return out
