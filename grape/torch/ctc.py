"""CTC loss with its lengths on the device: capturable in a CUDA graph, and deterministic.

PyTorch's CTC loss cannot be captured in a training step: its CUDA kernels take the input and
target lengths as host integers, so lengths given as tensors are read back (a host sync), and
Hugging Face's CTC heads first gather the targets with ``masked_select`` (another read-back, for
the output size). Its backward also adds with atomics when the problem is large, so parameters
after training are not reproducible run to run, and ``torch.use_deterministic_algorithms``
refuses it. cuDNN's CTC takes device lengths but, under capture, asserts every input length
below 256 frames (Wav2Vec2 makes 499 from ten seconds of audio).

:func:`ctc_loss` computes the same loss (Graves et al.'s forward-backward in log space) with
three small kernels compiled once per device: the forward variables, one block per utterance;
the backward variables the same way; the gradient with respect to the log-probabilities, one
thread per (frame, utterance), each summing over the extended target in a fixed order, so that
two runs give the same bits. Lengths and targets are read on the device; targets are padded
(``batch x max_target_length``), entries past an utterance's length ignored. On the CPU it is
PyTorch's own ``ctc_loss`` (no capture there, and deterministic).
"""

from __future__ import annotations

import torch

from grape.errors import GrapeError

__all__ = ["ctc_loss", "hf_ctc_loss"]

SOURCE = r"""
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ float lse2(float a, float b) {
    if (a == NEG_INF) return b;
    if (b == NEG_INF) return a;
    float m = fmaxf(a, b);
    return m + logf(expf(a - m) + expf(b - m));
}

// Extended target: blank between and around the labels.
__device__ long long label_at(const long long* targets, long long row, int s, long long blank) {
    return (s & 1) ? targets[row + (s >> 1)] : blank;
}

// log_probs (T, B, C) with strides; targets (B, L) int64; lengths int64 (B);
// variables (B, T, 2L+1). direction 0: forward (alpha), 1: backward (beta).
extern "C" __global__ void grape_ctc_variables(
        float* vars, float* nll, const float* lp, long long lp_t, long long lp_b,
        long long lp_c, const long long* targets, long long max_label,
        const long long* input_lengths, const long long* target_lengths, long long max_time,
        long long blank, int direction) {
    const int b = blockIdx.x;
    const long long width = 2 * max_label + 1;
    const long long tn = input_lengths[b];
    const long long span = 2 * target_lengths[b] + 1;
    const long long row = b * max_label;
    float* v = vars + (long long)b * max_time * width;
    for (long long t = 0; t < max_time; ++t) {
        const long long tt = direction ? max_time - 1 - t : t;
        for (long long s = threadIdx.x; s < width; s += blockDim.x) {
            float value = NEG_INF;
            if (s < span && tt < tn) {
                const long long c = label_at(targets, row, (int)s, blank);
                const float emit = lp[tt * lp_t + b * lp_b + c * lp_c];
                if (direction == 0) {
                    if (tt == 0) {
                        value = s < 2 ? emit : NEG_INF;
                    } else {
                        const float* prev = v + (tt - 1) * width;
                        float acc = prev[s];
                        if (s >= 1) acc = lse2(acc, prev[s - 1]);
                        if (s >= 2 && c != blank && c != label_at(targets, row, (int)s - 2, blank))
                            acc = lse2(acc, prev[s - 2]);
                        value = acc == NEG_INF ? NEG_INF : acc + emit;
                    }
                } else {
                    if (tt == tn - 1) {
                        value = s >= span - 2 ? emit : NEG_INF;
                    } else {
                        const float* next = v + (tt + 1) * width;
                        float acc = next[s];
                        if (s + 1 < span) acc = lse2(acc, next[s + 1]);
                        if (s + 2 < span && c != blank
                            && c != label_at(targets, row, (int)s + 2, blank))
                            acc = lse2(acc, next[s + 2]);
                        value = acc == NEG_INF ? NEG_INF : acc + emit;
                    }
                }
            }
            v[tt * width + s] = value;
        }
        __syncthreads();
    }
    if (direction == 0 && threadIdx.x == 0) {
        float total = NEG_INF;
        if (tn > 0) {
            total = v[(tn - 1) * width + span - 1];
            if (span >= 2) total = lse2(total, v[(tn - 1) * width + span - 2]);
        } else if (span == 1) {
            total = 0.0f;  // nothing to emit in no frames: probability one
        }
        nll[b] = -total;
    }
}

// grad (T, B, C) contiguous: d nll[b] / d lp[t, b, c], times grad_nll[b].
extern "C" __global__ void grape_ctc_gradient(
        float* grad, const float* alpha, const float* beta, const float* nll,
        const float* grad_nll, const float* lp, long long lp_t, long long lp_b, long long lp_c,
        const long long* targets, long long max_label, const long long* input_lengths,
        const long long* target_lengths, long long max_time, long long batch, long long classes,
        long long blank, int zero_infinity) {
    const long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long b = blockIdx.y;
    if (t >= max_time) return;
    float* g = grad + (t * batch + b) * classes;
    const float loss = nll[b];
    if (t >= input_lengths[b] || (zero_infinity && isinf(loss))) {
        for (long long c = 0; c < classes; ++c) g[c] = 0.0f;
        return;
    }
    for (long long c = 0; c < classes; ++c) g[c] = NEG_INF;
    const long long width = 2 * max_label + 1;
    const long long span = 2 * target_lengths[b] + 1;
    const long long row = b * max_label;
    const float* a = alpha + (b * max_time + t) * width;
    const float* be = beta + (b * max_time + t) * width;
    for (long long s = 0; s < span; ++s) {  // in order: the same bits every run
        const long long c = label_at(targets, row, (int)s, blank);
        g[c] = lse2(g[c], a[s] + be[s]);
    }
    const float scale = grad_nll[b];
    for (long long c = 0; c < classes; ++c) {
        const float p = lp[t * lp_t + b * lp_b + c * lp_c];
        // alpha and beta both hold the emission at t: divide one out.
        g[c] = (expf(p) - expf(g[c] + loss - p)) * scale;
    }
}
"""

_modules: dict[int, object] = {}


def _kernels(device: torch.device):
    from grape.cuda.nvrtc import Module

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _modules:
        with torch.cuda.device(index):
            torch.cuda.init()
            module = Module(SOURCE, name="grape_ctc.cu")
        _modules[index] = (module, module.function("grape_ctc_variables"),
                           module.function("grape_ctc_gradient"))
    return _modules[index]


def _launch(func, grid, block, values) -> None:
    from grape.cuda.nvrtc import launch

    launch(func, grid, block, values, stream=torch.cuda.current_stream().cuda_stream)


def _variables(log_probs, targets, input_lengths, target_lengths, blank, direction,
               out, nll) -> None:
    _, variables, _ = _kernels(log_probs.device)
    t, b, _ = log_probs.shape
    width = out.shape[-1]
    threads = min(1024, 32 * -(-width // 32))
    st, sb, sc = log_probs.stride()
    _launch(variables, (b, 1, 1), (threads, 1, 1),
            [out.data_ptr(), nll.data_ptr(), log_probs.data_ptr(), st, sb, sc,
             targets.data_ptr(), targets.shape[1], input_lengths.data_ptr(),
             target_lengths.data_ptr(), t, blank, direction])


class _CudaCTC(torch.autograd.Function):
    @staticmethod
    def forward(ctx, log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):
        t, b, _ = log_probs.shape
        width = 2 * targets.shape[1] + 1
        alpha = torch.empty(b, t, width, device=log_probs.device, dtype=torch.float32)
        nll = torch.empty(b, device=log_probs.device, dtype=torch.float32)
        _variables(log_probs, targets, input_lengths, target_lengths, blank, 0, alpha, nll)
        ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths, alpha, nll)
        ctx.blank, ctx.zero_infinity = blank, zero_infinity
        if zero_infinity:
            return torch.where(torch.isinf(nll), torch.zeros_like(nll), nll)
        return nll

    @staticmethod
    def backward(ctx, grad_nll):
        log_probs, targets, input_lengths, target_lengths, alpha, nll = ctx.saved_tensors
        t, b, c = log_probs.shape
        beta = torch.empty_like(alpha)
        scratch = torch.empty_like(nll)
        _variables(log_probs, targets, input_lengths, target_lengths, ctx.blank, 1, beta,
                   scratch)
        grad = torch.empty(t, b, c, device=log_probs.device, dtype=torch.float32)
        _, _, gradient = _kernels(log_probs.device)
        st, sb, sc = log_probs.stride()
        threads = min(256, 32 * -(-t // 32))
        _launch(gradient, (-(-t // threads), b, 1), (threads, 1, 1),
                [grad.data_ptr(), alpha.data_ptr(), beta.data_ptr(), nll.data_ptr(),
                 grad_nll.contiguous().data_ptr(), log_probs.data_ptr(), st, sb, sc,
                 targets.data_ptr(), targets.shape[1], input_lengths.data_ptr(),
                 target_lengths.data_ptr(), t, b, c, ctx.blank, int(ctx.zero_infinity)])
        return grad, None, None, None, None, None


def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor,
             target_lengths: torch.Tensor, *, blank: int = 0, reduction: str = "mean",
             zero_infinity: bool = False) -> torch.Tensor:
    """``torch.nn.functional.ctc_loss`` with padded targets and lengths as device tensors.

    ``log_probs``: (frames, batch, classes), float32, log-softmax of the logits;
    ``targets``: (batch, max_target_length), integers, entries past ``target_lengths``
    ignored; ``input_lengths``, ``target_lengths``: (batch,) integers on ``log_probs``'s
    device. ``reduction`` as PyTorch's: ``"mean"`` divides each utterance's loss by its
    target length, then averages over the batch.

    Raises
    ------
    GrapeError
        Shapes, dtypes or devices other than those above, or an unknown reduction.
    """
    if reduction not in ("mean", "sum", "none"):
        raise GrapeError(f"expected reduction 'mean', 'sum' or 'none', found {reduction!r}")
    if log_probs.dim() != 3 or targets.dim() != 2 or targets.shape[0] != log_probs.shape[1]:
        raise GrapeError(f"expected log_probs (frames, batch, classes) and targets (batch, "
                         f"max_target_length), found {tuple(log_probs.shape)} and "
                         f"{tuple(targets.shape)}")
    batch = log_probs.shape[1]
    for name, lengths in (("input_lengths", input_lengths), ("target_lengths", target_lengths)):
        if tuple(lengths.shape) != (batch,) or lengths.device != log_probs.device:
            raise GrapeError(f"expected {name} of shape ({batch},) on {log_probs.device}, "
                             f"found {tuple(lengths.shape)} on {lengths.device}")
    if log_probs.device.type != "cuda":
        nll = torch.nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths,
                                           blank=blank, reduction="none",
                                           zero_infinity=zero_infinity)
    else:
        if log_probs.dtype != torch.float32:
            raise GrapeError(f"expected float32 log_probs on CUDA (as PyTorch's CTC kernels "
                             f"take them), found {log_probs.dtype}")
        nll = _CudaCTC.apply(log_probs, targets.long().contiguous(),
                             input_lengths.long().contiguous(),
                             target_lengths.long().contiguous(), blank, zero_infinity)
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    return (nll / target_lengths.clamp(min=1).to(nll.dtype)).mean()


def hf_ctc_loss(model: torch.nn.Module, input_values: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The loss a Hugging Face CTC head (``Wav2Vec2ForCTC``, ``HubertForCTC``, ...) computes
    for ``labels`` (padded with negative values), with :func:`ctc_loss` in place of PyTorch's:
    nothing read back, so a training step around it can be captured.

    Frames per utterance come from ``attention_mask`` through the model's own
    ``_get_feat_extract_output_lengths``, on the device; without a mask every utterance fills
    its row. The blank, the reduction and ``zero_infinity`` are the model config's.
    """
    config = model.config
    logits = model(input_values, attention_mask=attention_mask).logits
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32)
    if attention_mask is None:
        frames = torch.full((logits.shape[0],), logits.shape[1], device=logits.device,
                            dtype=torch.long)
    else:
        frames = model._get_feat_extract_output_lengths(attention_mask.sum(-1)).long()
    valid = labels >= 0
    return ctc_loss(log_probs.transpose(0, 1), labels.clamp(min=0), frames, valid.sum(-1),
                    blank=config.pad_token_id, reduction=config.ctc_loss_reduction,
                    zero_infinity=config.ctc_zero_infinity)
