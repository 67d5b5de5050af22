"""How a broadcast publication cuts the weights: buckets of consecutive tensors of one dtype,
and the messages that carry them (packed small tensors, large ones from their own memory, cut
into pieces). Both ends derive the same plan from the layout (:mod:`.broadcast`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.transports.weights.interface import WeightLayout


def plan_buckets(layout: WeightLayout, bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensor indices per bucket; a bucket never mixes dtypes."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, spec in enumerate(layout.specs):
        if buckets and bucket_bytes > 0 and spec.dtype == dtype and size + spec.nbytes <= bucket_bytes:
            buckets[-1].append(i)
            size += spec.nbytes
        else:
            buckets.append([i])
            size, dtype = spec.nbytes, spec.dtype
    return buckets


@dataclass(frozen=True)
class Message:
    """One broadcast: elements ``[start, stop)`` of bucket ``bucket``.

    ``tensors`` are the layout indices whose elements it carries. A message of one tensor
    is sent from that tensor's memory (elements ``[offset, offset + stop - start)`` of it);
    a message of several is packed into a staging buffer first.
    """

    bucket: int
    start: int
    stop: int
    tensors: tuple[int, ...]
    offset: int = 0


def plan_messages(
    layout: WeightLayout, buckets: list[list[int]], direct_bytes: int, piece_bytes: int
) -> list[Message]:
    """The broadcasts of one publication, in order; both ends derive the same list from the layout.

    Within a bucket, a tensor of at least ``direct_bytes`` is its own message, cut into equal
    pieces of at most ``piece_bytes`` (0: never cut); the tensors between two such are packed
    into one message.
    """
    messages: list[Message] = []
    for b, bucket in enumerate(buckets):
        pos, run = 0, []
        for i in [*bucket, None]:
            spec = None if i is None else layout.specs[i]
            if spec is not None and spec.nbytes < direct_bytes:
                run.append(i)
                pos += spec.numel
                continue
            if run:
                size = sum(layout.specs[j].numel for j in run)
                messages.append(Message(b, pos - size, pos, tuple(run)))
                run = []
            if spec is not None:
                pieces = -(-spec.nbytes // piece_bytes) if piece_bytes > 0 else 1
                # Pieces start on whole 64-bit words of the tensor, so their word sums add up
                # to the tensor's (the same-host sender sums each piece as it writes it).
                word = max(1, 8 // torch.empty((), dtype=spec.dtype).element_size())
                per = -(-spec.numel // pieces // word) * word
                for offset in range(0, spec.numel, per):
                    n = min(per, spec.numel - offset)
                    messages.append(Message(b, pos + offset, pos + offset + n, (i,), offset))
                pos += spec.numel
    return messages
