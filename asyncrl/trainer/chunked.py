"""Token log-probs and entropies from hidden states, through the LM head in chunks of tokens.

The float32 logits of a micro-batch are its largest tensors: (tokens × vocabulary) × 4 bytes,
5 GB for 8,192 tokens of a 151,936-token vocabulary, and the log-softmax and its backward
add as much again several times. :class:`ChunkedLogprobs` never holds them whole: it takes
the final hidden states of the predicting positions (N, H) and the LM head's weight, and
for each chunk of ``chunk_tokens`` rows computes that chunk's logits, its log-softmax, the
log-probs of the tokens the chunk predicts and its entropies, then drops them. Backward
recomputes each chunk's logits from the saved hidden states (one more LM-head matmul per
chunk, the price of the memory), forms the gradient of the logits of that chunk in closed
form, and turns it into the chunk's rows of the hidden states' gradient and a float32
running sum of the weight's (and bias') gradient. A micro-batch of at most ``chunk_tokens``
rows is one chunk: its log-softmax is kept from forward to backward instead (no more memory
than a chunk, and no second matmul). Peak memory of the vocabulary side is so
a few (chunk × vocabulary) tensors plus one (vocabulary × H) float32 gradient, whatever
the micro-batch's size (measured in docs/trainer_memory.md).

Numerics are those of the unchunked path (``asyncrl.trainer.logprobs`` with
``trainer.logprob_chunk_tokens: 0``): the matmul runs in the compute dtype — the autocast
dtype when autocast is on for the device, else the weight's — and everything after it
(temperature, log-softmax, log-probs, entropy, their gradients) in float32; the gradient of
the logits goes back to the compute dtype for the two backward matmuls, as autograd does for
a ``Linear`` under autocast. Rows are independent, so forward values equal the unchunked
ones up to the matmul's own blocking; the weight gradient is summed chunk by chunk, so it
differs from one big matmul by float32 summation order (measured in tests/trainer/test_chunked.py).

This is a plain PyTorch implementation, the same on CPU and GPU. The fused GPU kernels on
PyPI compute a cross-entropy loss (the negative log-prob of a label), not what a policy
gradient needs here in one pass: the per-token log-probs at a temperature, renormalised over
a recorded support (Keep Sampling Mask), with the entropy and its gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.algorithms.losses import entropy_from_logprobs
from asyncrl.trainer.repeatable import add_at


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the LM head's matmul runs in: autocast's on this device when it is on, else the weight's."""
    device_type = weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


class ChunkedLogprobs(torch.autograd.Function):
    """``(logp, entropy)`` of ``T`` (row, token) pairs over ``N`` rows of hidden states; see the module.

    Inputs: ``hidden`` (N, H); ``weight`` (V, H) and ``bias`` (V,) or None, the LM head;
    ``rows`` and ``tokens`` (T,), the row that predicts each token and the token; ``support``
    (T, S) token ids (-1 padded) and ``has_support`` (T,) bool, or both None — where a pair
    has a support its log-prob is renormalised over it; ``temperature``; ``chunk`` rows per
    chunk; ``dtype`` the matmul's dtype; ``with_entropy`` and ``entropy_grad``. Outputs: the
    log-probs (T,) float32 and the entropies of the rows (N,) float32 (empty without
    ``with_entropy``; without gradient unless ``entropy_grad``).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: torch.Tensor,
        tokens: torch.Tensor,
        support: torch.Tensor | None,
        has_support: torch.Tensor | None,
        temperature: float,
        chunk: int,
        dtype: torch.dtype,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        # Pairs sorted by row, so each chunk's pairs are one slice; the slice bounds cost one sync.
        order = torch.argsort(rows, stable=True)
        starts = torch.arange(0, n + chunk, chunk, device=rows.device).clamp(max=n)
        bounds = torch.searchsorted(rows[order], starts).tolist()
        logp = torch.empty(rows.shape, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        w, b = _cast(weight, bias, dtype)
        kept = None
        with torch.autocast(hidden.device.type, enabled=False):
            for i, start in enumerate(range(0, n, chunk)):
                stop = min(start + chunk, n)
                # At most two (chunk x vocabulary) float32 tensors at a time, here and in backward.
                z = _scaled_logits(hidden[start:stop], w, b, dtype, temperature)
                pairs = order[bounds[i] : bounds[i + 1]]
                if support is not None:
                    sup = pairs[has_support[pairs]]
                    renormalised = _support_logprob(z, rows[sup] - start, tokens[sup], support[sup])[0]
                full = torch.log_softmax(z, dim=-1)
                del z
                logp[pairs] = full[rows[pairs] - start, tokens[pairs]]
                if support is not None:
                    logp[sup] = renormalised
                if with_entropy:
                    entropy[start:stop] = entropy_from_logprobs(full)
                # A micro-batch that fits in one chunk keeps its log-softmax for backward instead
                # of computing it again there: no more memory than one chunk, one matmul less.
                kept = full if n <= chunk and support is None else None
                del full
        ctx.save_for_backward(hidden, weight, bias, rows, tokens, support, has_support, order, entropy)
        ctx.config = (temperature, chunk, dtype, bounds, entropy_grad)
        ctx.kept = kept
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None):  # type: ignore[override]
        hidden, weight, bias, rows, tokens, support, has_support, order, entropy = ctx.saved_tensors
        temperature, chunk, dtype, bounds, entropy_grad = ctx.config
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        if grad_logp is None:
            grad_logp = torch.zeros(rows.shape, dtype=torch.float32, device=hidden.device)
        use_entropy = entropy_grad and grad_entropy is not None and grad_entropy.numel() > 0
        w, b = _cast(weight, bias, dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for i, start in enumerate(range(0, n, chunk)):
                stop = min(start + chunk, n)
                h = hidden[start:stop].to(dtype)
                pairs = order[bounds[i] : bounds[i + 1]]
                r, t, g = rows[pairs] - start, tokens[pairs], grad_logp[pairs].float()
                if ctx.kept is not None:  # the only chunk, kept by forward (never with a support)
                    full, ctx.kept = ctx.kept, None
                else:
                    z = _scaled_logits(h, w, b, dtype, temperature)
                    if support is not None:
                        sup = has_support[pairs]
                        rs, ss = r[sup], support[pairs[sup]]
                        q = _support_logprob(z, rs, t[sup], ss)[1]
                    full = torch.log_softmax(z, dim=-1)
                    del z
                # d logp[t] / dz = onehot(t) - softmax(z), or - softmax over the support where recorded.
                on_full = g if support is None else torch.where(sup, 0.0, g)
                row_grad = add_at(
                    torch.zeros(stop - start, dtype=torch.float32, device=h.device), (r,), on_full
                )
                row_grad = row_grad.unsqueeze(-1)
                if use_entropy:
                    # d entropy / dz = -p (log p + entropy); computed in place of the log-softmax.
                    p = full.exp()
                    ge = grad_entropy[start:stop].float().unsqueeze(-1)
                    grad_z = full.add_(entropy[start:stop].unsqueeze(-1)).mul_(p).mul_(ge.neg_())
                    grad_z.sub_(p.mul_(row_grad))
                    del p
                else:
                    grad_z = full.exp_().mul_(row_grad.neg_())
                del full
                add_at(grad_z, (r, t), g)
                if support is not None:
                    add_at(
                        grad_z, (rs.unsqueeze(-1).expand_as(ss), ss.clamp(min=0)), -g[sup].unsqueeze(-1) * q
                    )
                if temperature != 1.0:
                    grad_z /= temperature
                if need_bias:
                    grad_bias += grad_z.sum(0)
                grad_logits = grad_z.to(dtype)
                del grad_z
                if need_hidden:
                    grad_hidden[start:stop] = (grad_logits @ w).to(hidden.dtype)
                if need_weight:
                    if dtype == torch.float32:
                        grad_weight.addmm_(grad_logits.t(), h)
                    else:
                        grad_weight += (grad_logits.t() @ h).float()
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, *([None] * 9)


def _cast(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # One cast for all chunks (as autocast caches its cast of a weight), none when the dtypes agree.
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _scaled_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    temperature: float,
) -> torch.Tensor:
    z = F.linear(hidden.to(dtype), weight, bias).float()
    if temperature != 1.0:  # the same division as the unchunked path, skipped at 1 as there
        z.div_(temperature)  # z is the matmul's fresh output (or its float32 copy)
    return z


def _support_logprob(
    z: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, support: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each token renormalised over its support, and the softmax over the support (0 on padding)."""
    kept = z[rows.unsqueeze(-1), support.clamp(min=0)].masked_fill(support < 0, float("-inf"))
    lse = torch.logsumexp(kept, dim=-1)
    return z[rows, tokens] - lse, torch.exp(kept - lse.unsqueeze(-1))


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    *,
    support: torch.Tensor | None = None,
    has_support: torch.Tensor | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``tokens`` predicted by ``hidden[rows]`` (T,), and each row's entropy (N,) or None.

    See :class:`ChunkedLogprobs`; ``chunk_tokens`` must be positive. ``dtype``: the matmul's
    (float32 for a float32 head, :mod:`asyncrl.models.head`); None: :func:`compute_dtype`.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if (support is None) != (has_support is None):
        raise ValueError("support and has_support go together")
    logp, entropy = ChunkedLogprobs.apply(
        hidden,
        weight,
        bias,
        rows,
        tokens,
        support,
        has_support,
        float(temperature),
        int(chunk_tokens),
        dtype or compute_dtype(weight),
        with_entropy,
        with_entropy and entropy_grad,
    )
    return logp, entropy if with_entropy else None
