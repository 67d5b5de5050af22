"""File-based weight sync: safetensors files plus an atomic version marker.

The sender writes ``weights-v{version}.safetensors`` under a temporary name, fsyncs and
renames it, then replaces ``LATEST`` (a small JSON: version, file, checksum, layout
fingerprint) the same way. A reader that sees ``LATEST`` therefore always finds a
complete file. The version and fingerprint are also stored in the safetensors metadata
and checked against the marker. Older files beyond ``keep`` are removed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from asyncrl.transports.weights.interface import (
    SyncStats,
    WeightLayout,
    WeightSyncError,
    check_publish,
    checksum,
    verify,
)

MARKER = "LATEST"


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class FileSender:
    def __init__(self, directory: str | Path, layout: WeightLayout, keep: int = 2) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self.keep = keep
        self._written: list[Path] = []

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        t0 = time.perf_counter()
        tensors = {n: t.detach().contiguous().cpu() for n, t in named}
        check_publish(self.layout, tensors, version, str(self.dir))
        chk = checksum(tensors.values())
        path = self.dir / f"weights-v{version}.safetensors"
        meta = {"version": str(version), "fingerprint": self.layout.fingerprint}
        _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
        marker = {
            "version": version,
            "file": path.name,
            "checksum": chk,
            "fingerprint": self.layout.fingerprint,
        }
        _atomic_write(self.dir / MARKER, lambda tmp: tmp.write_text(json.dumps(marker)))
        self._written.append(path)
        while len(self._written) > self.keep:
            self._written.pop(0).unlink(missing_ok=True)
        return SyncStats(version, self.layout.nbytes, time.perf_counter() - t0)

    def close(self) -> None:
        pass


class FileReceiver:
    def __init__(self, directory: str | Path, layout: WeightLayout) -> None:
        self.dir = Path(directory)
        self.layout = layout

    def receive(self, version: int, timeout: float) -> tuple[int, dict[str, torch.Tensor]]:
        deadline = time.monotonic() + timeout
        seen = None
        while True:
            try:
                marker = json.loads((self.dir / MARKER).read_text())
                seen = marker["version"]
                if marker["version"] >= version:
                    return self._load(marker)
            except FileNotFoundError:
                pass  # no marker yet, or the file it names was just rotated away; look again
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"{self.dir}: version {version} not published within {timeout:g}s (latest seen: {seen})"
                )
            time.sleep(0.005)

    def _load(self, marker: dict) -> tuple[int, dict[str, torch.Tensor]]:
        source = f"weights file {self.dir / marker['file']}"
        if marker["fingerprint"] != self.layout.fingerprint:
            raise WeightSyncError(f"{source}: layout fingerprint differs from this model's")
        path = self.dir / marker["file"]
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
        if meta.get("version") != str(marker["version"]) or meta.get("fingerprint") != marker["fingerprint"]:
            raise WeightSyncError(f"{source}: its metadata {meta} disagrees with the marker {marker}")
        tensors = load_file(str(path))
        verify(tensors, self.layout, marker["checksum"], marker["version"], source)
        return marker["version"], tensors

    def close(self) -> None:
        pass
