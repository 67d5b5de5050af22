"""The teacher's top-k tokens at every completion position, and the divergence over them.

With ``distill.top_k`` = k the teacher gives, besides its log-prob of each sampled token, its k
most likely tokens at that position with their log-probs. A sample carries them as bytes
(:func:`pack_top`: the (L, k) int32 ids, then the (L, k) float32 log-probs), as routes are
carried: one compact object that pickles to another process, a Ray actor or ``rollouts.pt`` as it
is, where thousands of small tensors would each travel as a shared-memory handle.

:func:`bucketed_kl` compares teacher and student over k + 1 outcomes: each of the teacher's k
tokens, and one bucket for the rest of the vocabulary (1 minus the k tokens' mass, on each side).
That is a true divergence between two distributions — never negative, 0 exactly when the student
gives each of the k tokens the teacher's probability and the rest the teacher's rest — and with
k the whole vocabulary it is the full KL. A divergence over the k tokens alone would be neither:
it is minimised by moving all of the student's mass onto the k tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

Divergence = Literal["forward", "reverse"]

# The rest bucket's mass is at least this much on either side: where the k tokens hold all of it
# (k the vocabulary, or float32 rounding), log(1 - mass) has no finite value and no gradient.
REST_FLOOR = 1e-6
# Teacher log-probs below this count as this (0 probability stays finite in the products).
TEACHER_FLOOR = -100.0


def pack_top(
    ids: Sequence[Sequence[int]] | np.ndarray, logprobs: Sequence[Sequence[float]] | np.ndarray
) -> bytes:
    """One completion's (L, k) top-k ids and log-probs as the bytes a sample carries."""
    ids = np.asarray(ids, dtype=np.int32)
    logprobs = np.asarray(logprobs, dtype=np.float32)
    if ids.ndim != 2 or ids.shape != logprobs.shape:
        raise ValueError(
            f"top-k ids {ids.shape} and log-probs {logprobs.shape} must be two (tokens, k) arrays of one shape"
        )
    return ids.tobytes() + logprobs.tobytes()


def top_width(data: bytes, length: int) -> int:
    """k of :func:`pack_top`'s bytes for ``length`` tokens; a ValueError if they are not whole tokens."""
    per_k = 8 * length  # an int32 id and a float32 log-prob per token and rank
    if length <= 0 or not data or len(data) % per_k:
        raise ValueError(
            f"{len(data)} bytes of top-k tokens are not k whole entries for each of {length} tokens"
        )
    return len(data) // per_k


def unpack_top(data: bytes, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_top`'s bytes for ``length`` tokens: the (L, k) ids (long) and log-probs (float32)."""
    k = top_width(data, length)
    half = len(data) // 2
    ids = np.frombuffer(data, dtype=np.int32, count=length * k).reshape(length, k)
    logprobs = np.frombuffer(data, dtype=np.float32, offset=half).reshape(length, k)
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(logprobs.copy())


def _rest(logprobs: torch.Tensor) -> torch.Tensor:
    """log(1 - sum exp(logprobs)) over the last dimension: the log-mass of every other token."""
    inside = torch.logsumexp(logprobs, dim=-1).clamp(max=math.log1p(-REST_FLOOR))
    # log1p(-exp(x)) loses precision near 0 and log(-expm1(x)) far from it: switch at -log 2.
    near = torch.log(-torch.expm1(inside))
    far = torch.log1p(-torch.exp(inside.clamp(max=-math.log(2))))
    return torch.where(inside > -math.log(2), near, far).unsqueeze(-1)


def bucketed_kl(student: torch.Tensor, teacher: torch.Tensor, divergence: Divergence) -> torch.Tensor:
    """Per position, the KL over the teacher's k tokens and one rest bucket (module docstring).

    ``student`` and ``teacher``: (..., k) log-probs of the same k tokens (the student's with a
    gradient). ``forward``: KL(teacher ‖ student), which covers every token the teacher gives mass;
    ``reverse``: KL(student ‖ teacher), which seeks the teacher's modes. Returns (...) float32.
    """
    student = student.float()
    teacher = teacher.float().clamp(min=TEACHER_FLOOR)
    s = torch.cat([student, _rest(student)], dim=-1)
    t = torch.cat([teacher, _rest(teacher)], dim=-1)
    if divergence == "forward":
        return (t.exp() * (t - s)).sum(-1)
    if divergence == "reverse":
        return (s.exp() * (s - t)).sum(-1)
    raise ValueError(f"divergence must be 'forward' or 'reverse', got {divergence!r}")
