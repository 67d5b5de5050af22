"""A pivot a generator found, with its prefix, and the event that reports it (pivot resampling's own)."""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass
from typing import Any

from asyncrl.types import PartialGroup, Pivot, Prompt, Sample


@dataclass
class FoundPivot:
    """A pivot a generator found, with what its branch group starts from: the prompt, and the
    prefix as a completion stopped there (its tokens keep their log-probs, versions and routes;
    ``loss_mask`` 0: trained as prompt). It crosses the controller, which holds it until its
    branch group is trained (or a checkpoint keeps it)."""

    pivot: Pivot
    prompt: Prompt
    prefix: Sample

    def branch_group(self, group_id: int) -> PartialGroup:
        """The branch group to generate under ``group_id``: K completions, each at the prefix."""
        samples = {
            k: dataclasses.replace(
                self.prefix, group_id=group_id, **{n: list(getattr(self.prefix, n)) for n in _PER_TOKEN}
            )
            for k in range(self.pivot.branches)
        }
        return PartialGroup(group_id, self.prompt, samples, self.pivot)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (a checkpoint's controller.json): route bytes as base64."""
        prefix = self.prefix.to_dict()
        if prefix["routes"] is not None:
            prefix["routes"] = [None if r is None else base64.b64encode(r).decode() for r in prefix["routes"]]
        if prefix["prompt_routes"] is not None:
            prefix["prompt_routes"] = base64.b64encode(prefix["prompt_routes"]).decode()
        return {
            "pivot": dataclasses.asdict(self.pivot),
            "prompt": dataclasses.asdict(self.prompt),
            "prefix": prefix,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FoundPivot:
        prefix = dict(data["prefix"])
        if prefix.get("routes") is not None:
            prefix["routes"] = [None if r is None else base64.b64decode(r) for r in prefix["routes"]]
        if prefix.get("prompt_routes") is not None:
            prefix["prompt_routes"] = base64.b64decode(prefix["prompt_routes"])
        return cls(Pivot(**data["pivot"]), Prompt(**data["prompt"]), Sample.from_dict(prefix))


_PER_TOKEN = ("completion_ids", "logprobs", "versions", "loss_mask")


@dataclass
class PivotsFound:
    """Pivots a generator found in the failed completions of groups it scored, each with its prefix
    (the one payload the controller holds: it expands them in later steps)."""

    worker: str
    pivots: list[FoundPivot]
