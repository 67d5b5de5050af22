"""Versioned weight sync: the seam between the trainer and the engines.

A sender publishes a complete set of named tensors under a policy version; a receiver
returns exactly that set, verified, or raises. Every transport checks the same three
things before an engine may use what it received:

* the *layout* — tensor names, shapes and dtypes — matches the receiver's model
  (a fingerprint computed on both sides);
* the *version* is the one announced (never older than what the engine has);
* the *content* is complete and untorn: a checksum over the bytes of every tensor,
  computed by the sender and recomputed by the receiver.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


class WeightSyncError(RuntimeError):
    """A weight update that is incomplete, torn, of the wrong version or layout, or late."""


class SyncInterrupted(WeightSyncError):
    """A wait on a broadcast group that is being replaced was given up (see ``interrupt``)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class WeightLayout:
    """The ordered list of tensors a sync moves; both ends derive it from their own model."""

    specs: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]]) -> WeightLayout:
        return cls(tuple(TensorSpec(n, tuple(t.shape), t.dtype) for n, t in named))

    @property
    def fingerprint(self) -> str:
        text = ";".join(f"{s.name}:{s.shape}:{s.dtype}" for s in self.specs)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]


# The largest prime below 2**53: checksums are integers smaller than this, so a float64 (the
# shm header, the broadcast header, JSON) carries them exactly.
CHECKSUM_MODULUS = (1 << 53) - 111


def word_sum(t: torch.Tensor) -> int:
    """The tensor's bytes read as little-endian 64-bit words from its first byte (a last
    partial word zero-padded), summed modulo 2**64.

    Integer addition is associative, so the result is the same whatever the thread count or
    reduction order (a float sum is not: summing 100M float32 values in float64 gives other
    last bits with 1 and with 2 threads), and it reads memory once, at about memory speed,
    with no converted copy.
    """
    data = t.detach().reshape(-1).view(torch.uint8)
    body = data.numel() // 8 * 8
    words = data[:body]
    if words.storage_offset() % 8:  # a view that starts between two words: realign by copying
        words = words.clone()
    total = int(words.view(torch.int64).sum()) if body else 0
    tail = data[body:]
    if tail.numel():
        total += int.from_bytes(bytes(tail.cpu().tolist()), "little")
    return total % (1 << 64)


def checksum(tensors: Iterable[torch.Tensor]) -> float:
    """An order-dependent fingerprint of the bytes of every tensor (detects partial or torn copies).

    ``sum((i + 1) * word_sum(t_i)) mod CHECKSUM_MODULUS``, returned as an exactly representable
    float. The modulus is prime, so a change of one tensor's word sum goes unnoticed only
    if it is a multiple of the modulus.
    """
    return combine(word_sum(t) for t in tensors)


def combine(word_sums: Iterable[int]) -> float:
    """The checksum of tensors whose :func:`word_sum` values are given, in order."""
    total = 0
    for i, s in enumerate(word_sums):
        total = (total + (i + 1) * s) % CHECKSUM_MODULUS
    return float(total)


def check_publish(layout: WeightLayout, tensors: dict[str, torch.Tensor], version: int, source: str) -> None:
    """Refuse a publication whose names, shapes or dtypes differ from the layout, before anything is written."""
    got = WeightLayout.of(tensors.items())
    if got != layout:
        diff = next(
            (
                f"got {g.name} {list(g.shape)} {g.dtype}, layout has {w.name} {list(w.shape)} {w.dtype}"
                for g, w in zip(got.specs, layout.specs, strict=False)
                if g != w
            ),
            f"{len(got.specs)} tensors instead of {len(layout.specs)}",
        )
        raise WeightSyncError(f"{source}: publish of version {version} does not match the layout ({diff})")


def verify(
    received: dict[str, torch.Tensor],
    layout: WeightLayout,
    expected_checksum: float,
    version: int,
    source: str,
    word_sums: list[int] | None = None,
) -> None:
    """Raise unless ``received`` is complete and matches ``expected_checksum``.

    ``word_sums`` (in layout order) are used instead of rereading the tensors when the
    receiver computed them while the data arrived.
    """
    missing = [n for n in layout.names if n not in received]
    if missing or len(received) != len(layout.specs):
        raise WeightSyncError(
            f"{source}: version {version} is incomplete (missing {missing[:5]}, got {len(received)} tensors)"
        )
    got = checksum(received[n] for n in layout.names) if word_sums is None else combine(word_sums)
    if got != expected_checksum:
        raise WeightSyncError(
            f"{source}: version {version} failed its checksum ({got!r} != {expected_checksum!r})"
        )


def tensor_checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """One fingerprint per tensor, for the end-to-end check of what an engine holds after an update.

    The trainer computes them from what it publishes and sends them with the version,
    apart from the transport; see :func:`check_checksums`.
    """
    return {name: checksum([t]) for name, t in named}


def check_checksums(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, float], version: int, where: str
) -> None:
    """Every tensor of ``expected`` is in ``actual`` with the trainer's checksum, or the error names it.

    Transports verify what they deliver; this verifies what the engine holds afterwards, so
    an update that was received but not applied (the engine still computing with older
    weights under a new version number) cannot pass silently.
    """
    for name, want in expected.items():
        if name not in actual:
            raise WeightSyncError(f"{where}: after the update to version {version} it has no tensor {name}")
        got = checksum([actual[name]])
        if got != want:
            raise WeightSyncError(
                f"{where}: after the update to version {version}, {name} differs from the trainer's "
                f"(checksum {got!r}, trainer {want!r})"
            )


@dataclass
class SyncStats:
    version: int
    nbytes: int
    seconds: float


class WeightSender(Protocol):
    """Trainer side."""

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats: ...

    def close(self) -> None: ...


class WeightReceiver(Protocol):
    """Engine side: ``receive`` blocks until ``version`` (or newer) is available, up to ``timeout``."""

    def receive(self, version: int, timeout: float) -> tuple[int, dict[str, torch.Tensor]]: ...

    def close(self) -> None: ...


@runtime_checkable
class InterruptibleReceiver(Protocol):
    """A receiver whose wait another thread can end at once (a broadcast group's, which a
    regroup or a stop replaces); other receivers' waits end by their timeout."""

    def interrupt(self) -> None: ...


@runtime_checkable
class RegroupingSender(Protocol):
    """A sender whose group of receivers can change while the run goes (the broadcast
    transport's background publisher, on an elastic runtime)."""

    def regroup(self, make_sender: Callable[[], WeightSender | None]) -> None: ...

    def stop_waiting(self) -> None: ...
