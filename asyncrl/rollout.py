"""Rollout: prompts in, scored Groups out.

For each prompt the worker asks the engine for G completions, decodes them, calls the
reward function on each and assembles one Group per prompt. Completions find their prompt
through the request id, which carries the group id and prompt id — never by position.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from asyncrl.engine import GenerationRequest, SamplingParams
from asyncrl.tasks.rewards import RewardFn, score
from asyncrl.types import Group, Prompt, Sample


@dataclass
class RolloutStats:
    groups: int = 0
    samples: int = 0
    reward_errors: int = 0
    dropped_groups: int = 0


class RolloutWorker:
    def __init__(
        self,
        engine,
        tokenizer: PreTrainedTokenizerBase,
        reward_fn: RewardFn,
        sampling: SamplingParams,
        group_size: int,
        reward_on_error: str = "zero",
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.sampling = sampling
        self.group_size = group_size
        self.reward_on_error = reward_on_error
        self.stats = RolloutStats()
        self._next_group_id = 0

    def encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer(prompt.text, add_special_tokens=False).input_ids

    def generate_groups(self, prompts: list[Prompt]) -> list[Group]:
        """Generate, score and group completions for a batch of prompts; drops groups per policy."""
        requests, by_group = [], {}
        for prompt in prompts:
            group_id = self._next_group_id
            self._next_group_id += 1
            by_group[group_id] = prompt
            ids = self.encode(prompt)
            for k in range(self.group_size):
                requests.append(GenerationRequest(f"{group_id}/{k}", ids, self.sampling))
        results = self.engine.generate(requests)
        if len(results) != len(requests):
            raise ValueError(f"engine returned {len(results)} results for {len(requests)} requests")
        request_by_id = {r.request_id: r for r in requests}
        samples: dict[int, list[Sample]] = {gid: [] for gid in by_group}
        for res in results:
            group_id = int(res.request_id.split("/", 1)[0])
            prompt = by_group[group_id]
            prompt_ids = request_by_id[res.request_id].prompt_ids
            samples[group_id].append(self._score(prompt, group_id, prompt_ids, res))
        groups = []
        for group_id, prompt in by_group.items():
            group = Group(group_id=group_id, prompt=prompt, samples=samples[group_id])
            self.stats.samples += group.size
            if self.reward_on_error == "drop_group" and any(s.reward_error for s in group.samples):
                self.stats.dropped_groups += 1
                continue
            self.stats.groups += 1
            groups.append(group)
        return groups

    def _score(self, prompt: Prompt, group_id: int, prompt_ids: list[int], res) -> Sample:
        text = self.tokenizer.decode(
            [t for t in res.completion_ids if t not in self.sampling.stop_token_ids], skip_special_tokens=True
        )
        reward, error = score(self.reward_fn, text, prompt.text, prompt.answer, prompt.extra)
        if error is not None:
            self.stats.reward_errors += 1
            reward = 0.0 if self.reward_on_error == "zero" else None
        return Sample(
            prompt_id=prompt.prompt_id,
            group_id=group_id,
            prompt_ids=list(prompt_ids),
            completion_ids=list(res.completion_ids),
            logprobs=list(res.logprobs),
            versions=list(res.versions),
            loss_mask=[1] * len(res.completion_ids),
            finish_reason=res.finish_reason,
            completion_text=text,
            reward=reward,
            reward_error=error,
        )
