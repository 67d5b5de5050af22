"""The flat layout: a micro-batch's inputs end to end in one row, without padding.

Each sample's model input (its prompt and the completion tokens fed back in) follows the
previous one's in a single row of T tokens, T the sum of the inputs' lengths; its position
ids restart at 0. The model is called without an attention mask: transformers reads the
sample boundaries from the position ids (a position that does not follow its neighbour by
one starts a sequence) and keeps every token's attention within its own sample. How it does
so is the attention implementation's (``trainer.attention``): ``flash_attention_2`` and
``flash_attention_3`` run their variable-length kernels over the samples, ``flex_attention``
a block-sparse mask that skips the blocks between samples, ``sdpa`` and ``eager`` a dense
(T x T) mask, exact as well but with attention costing T² per micro-batch. No position is
padding, so the micro-batch costs its real tokens: what TRL calls padding-free training
and verl removing the padding.

Exact, like the other layouts: the same log-probs and gradients as the padded layout
(tests/trainer/test_flat.py). Layers that are not attention (a state-space or linear
attention layer) would carry their state from one sample into the next, so such models get
the padded layout, with a warning (:func:`~asyncrl.trainer.packing.packing_for`).
"""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.models.token_records import TOKEN_RECORDS, records_tensor
from asyncrl.trainer.batching import FlatInputs, MicroBatch, per_token_tensors, trained_span
from asyncrl.types import Sample


def input_length(sample: Sample) -> int:
    """Tokens a sample takes in the flat row: its prompt and its completion less the last trained token."""
    return len(sample.prompt_ids) + trained_span(sample) - 1


def collate_flat(samples: list[Sample], pad_token_id: int) -> MicroBatch:
    """The flat layout of ``samples`` (module docstring)."""
    per_token = per_token_tensors(samples, pad_token_id)
    spans = [trained_span(s) for s in samples]
    lengths = np.array([len(s.prompt_ids) + n - 1 for s, n in zip(samples, spans, strict=True)])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tokens = [
        t for s, n in zip(samples, spans, strict=True) for t in (s.prompt_ids + s.completion_ids[: n - 1])
    ]
    input_ids = torch.tensor([tokens], dtype=torch.long)
    position_ids = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))[None]
    # Completion token j of sample i is predicted by the row's position start_i + len(prompt_i) - 1 + j.
    b, r = per_token["completion_ids"].shape
    columns = np.arange(r)
    first = starts + np.array([len(s.prompt_ids) for s in samples]) - 1
    within = columns < np.array(spans)[:, None]
    positions = np.where(within, first[:, None] + columns, -1)
    logit_index = np.zeros((b, r), dtype=np.int64)
    logit_index[within] = np.arange(int(within.sum()))  # row-major: the kept positions in row order
    flat = FlatInputs(
        torch.from_numpy(positions), torch.from_numpy(positions[within]), torch.from_numpy(logit_index)
    )
    return MicroBatch(
        samples,
        **per_token,
        input_ids=input_ids,
        position_ids=position_ids,
        input_records=_flat_records(samples, lengths),
        flat=flat,
    )


def _flat_records(samples: list[Sample], lengths: np.ndarray) -> dict[str, torch.Tensor]:
    """Each per-token record of the inputs as a (1, T, record width) tensor, sample after sample."""
    width = int(lengths.max())
    real = torch.from_numpy(np.arange(width) < lengths[:, None])
    out = {}
    for name, kind in TOKEN_RECORDS.entries():
        rows = [kind.inputs_of(s, int(n)) for s, n in zip(samples, lengths, strict=True)]
        # Row i's records start at column 0 (they end at its length); boolean indexing walks
        # rows in order, so the real columns come out sample after sample, as in the flat row.
        tensor = records_tensor(kind, rows, width, [int(n) for n in lengths])
        if tensor is not None:
            out[name] = tensor[real][None]
    return out


def plan_flat(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """Samples into as few micro-batches of at most ``token_budget`` flat tokens as first-fit
    decreasing finds (a sample longer than the budget gets one of its own).

    In the flat layout a micro-batch costs its samples' tokens whichever samples they are, so
    only their number matters. Deterministic: longest first (ties in batch order), each into
    the first micro-batch it fits; each micro-batch keeps its samples in batch order.
    """
    lengths = [input_length(s) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for k, left in enumerate(room):
            if lengths[i] <= left:
                bins[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(token_budget - lengths[i])
    return [[samples[i] for i in sorted(chunk)] for chunk in bins]
