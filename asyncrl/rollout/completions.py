"""Single completions: prompts in, groups of G completions scored by reward functions out.

For each prompt the rollout asks the engine for G completions, decodes them, scores the
group with the task's reward functions and returns it. Completions find their prompt
through the request id (``group_id/k``), never by position. The seam it implements, and a
group's life through it: :mod:`asyncrl.rollout.interface`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from asyncrl.config import DEFAULT_POLICY
from asyncrl.engine.interface import resume_request, sample_seed
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.errors import DatasetError
from asyncrl.prompts.chat import encode_prompt
from asyncrl.rewards.registry import RewardFn
from asyncrl.rewards.scoring import GroupToScore, RewardSet
from asyncrl.rewards.step_rewards import cut_steps
from asyncrl.rollout.interface import Rollout, RolloutStats, Work
from asyncrl.types import Group, GroupState, PartialGroup, Pivot, Prompt, Sample, Versions, oldest_for

SCORING_WAIT_S = 0.05  # longest a step waits for scoring when the engine has nothing to decode


def _step_rewards(
    steps: list[float | None] | None, spans: list[tuple[int, int]], delimiter: str
) -> tuple[list[float | None], str | None]:
    """A sample's step rewards (None for each step when no function gave any), or an error when a
    function did not reward each step it was given (the steps then get none)."""
    if steps is None:
        return [None] * len(spans), None
    if len(steps) != len(spans):
        return [None] * len(spans), (
            f"returned {len(steps)} step rewards for {len(spans)} steps (task.step_delimiter={delimiter!r})"
        )
    return steps, None


@dataclass
class _PendingGroup:
    prompt: Prompt
    prompt_ids: list[int]
    samples: dict[int, Sample]
    size: int  # completions: G, or a branch group's K
    pivot: Pivot | None = None  # a branch group's: its prefix is trained as prompt
    state: GroupState = GroupState.GENERATING  # then scoring, until a step returns it


class CompletionRollout(Rollout):
    """G completions of each prompt, scored as a group by the task's reward functions.

    A group is complete when all G of its completions are; it is then scored as a whole (a
    batched reward function sees the G completions of its prompt together; the groups that
    complete in one engine step are scored as one batch, so a time-limited reward function
    runs their calls concurrently), and its samples
    are ordered by completion index, so a group's content does not depend on the order in
    which its completions finished.
    """

    def __init__(
        self,
        engine,
        tokenizer: PreTrainedTokenizerBase,
        reward_fn: RewardFn | RewardSet,
        sampling: SamplingParams,
        group_size: int,
        reward_on_error: str = "zero",
        eos_after: int | None = None,
        seed: int = 0,
        scoring_threads: int = 0,
        step_delimiter: str | None = None,
    ) -> None:
        """``eos_after``: with decode_past_eos, the EOS id at which an answer ends although generation went on.

        ``seed``: completion k of group g samples with seed (seed, g, k), so a group's
        completions do not depend on which engine generates them or what runs beside them.

        ``scoring_threads``: with N > 0, finished groups are handed to N scoring threads and
        the engine goes on decoding; a scored group is returned by a later :meth:`step`. (With
        ``task.reward_timeout_s`` the calls themselves run in reward processes; with
        ``task.reward_workers``, the threads wait on the run's reward pool.)

        ``step_delimiter``: cut completions into steps for step rewards (:mod:`asyncrl.rewards.step_rewards`).
        """
        super().__init__(group_size, RolloutStats())
        self.engine = engine
        self.seed = seed
        self.eos_after = eos_after
        # EOS is left out of the text where it ends the answer; a stop token of rollout.stop_token_ids
        # stays in it, as the token completing a stop string does (TRL decodes the sampled ids alike).
        self.eos_ids = set(sampling.stop_token_ids) & {tokenizer.eos_token_id}
        if eos_after is not None:
            self.eos_ids.add(eos_after)
        self.tokenizer = tokenizer
        self.rewards = RewardSet.of(reward_fn)
        self.sampling = sampling
        self.reward_on_error = reward_on_error
        self.step_delimiter = step_delimiter
        self._pending: dict[int, _PendingGroup] = {}  # submitted and not yet returned
        self._complete_now: list[int] = []  # groups a submit completed (see submit), returned by step
        self._scorers = (
            concurrent.futures.ThreadPoolExecutor(scoring_threads, thread_name_prefix="asyncrl-scoring")
            if scoring_threads > 0
            else None
        )
        self._scoring: list[tuple[concurrent.futures.Future, list[Group]]] = []  # batches in the threads
        self._sampling: dict[str, SamplingParams] = {}  # of requests in flight, to resume them

    def encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    @property
    def groups_in_flight(self) -> int:
        return len(self._pending)

    @property
    def has_work(self) -> bool:
        """Whether anything submitted is still being generated or scored (or done, not yet returned)."""
        if self.abandoned:
            return False
        return self.engine.has_work or bool(self._complete_now) or bool(self._scoring)

    def submit(self, work: Work, partials: dict[int, PartialGroup] | None = None) -> None:
        """Queue G completions for each (group_id, prompt).

        A group in ``partials`` (stopped mid-generation by :meth:`preempt`, e.g. before a
        resume) continues from there: its finished completions are kept and its prefixes
        are resumed with their own seeds, as after an abort; only the rest start afresh. A
        branch group (pivot resampling: ``PartialGroup.pivot``) is K completions that all
        start at the pivot's prefix: their identical contexts are prefilled once.
        """
        partials = partials or {}
        for group_id, prompt in work:
            if group_id in self._pending:
                raise ValueError(f"group {group_id} is already in flight")
            ids = self.encode(prompt)
            partial = partials.get(group_id)
            pivot = partial.pivot if partial else None
            size = self.group_size if pivot is None else pivot.branches
            budgets = self._budgets(prompt)
            if pivot is not None:  # the source completion's budget, for each continuation
                budgets = [budgets[pivot.sample]] * size
            done = {k: s for k, s in partial.samples.items() if s.finish_reason != "abort"} if partial else {}
            prefixes = partial.prefixes if partial else {}
            for k, p in prefixes.items():
                if len(p.completion_ids) >= budgets[k]:
                    # Resumed under a smaller token budget than it was sampled with: the
                    # prefix already reaches it, so the completion ends there.
                    cut = GenerationResult(
                        **vars(p.cut(budgets[k])), request_id=f"{group_id}/{k}", finish_reason="length"
                    )
                    done[k] = self._sample(prompt, group_id, ids, cut, pivot)
            self._pending[group_id] = _PendingGroup(prompt, ids, done, size, pivot)
            if len(done) == size:
                self._complete_now.append(group_id)
            for k in range(size):
                if k in done:
                    continue
                sampling = self.sampling
                if budgets[k] != sampling.max_new_tokens:
                    sampling = replace(sampling, max_new_tokens=budgets[k])
                request_id = f"{group_id}/{k}"
                self._sampling[request_id] = sampling
                seed = sample_seed(self.seed, group_id * self.group_size + k)
                if pivot is not None:  # a seed space of their own: K may differ from G
                    seed = sample_seed(self.seed, (1 << 39) + group_id * size + k)
                prefix = prefixes[k].tokens() if k in prefixes else None
                self.engine.add_request(
                    GenerationRequest(request_id, ids, sampling, seed=seed, prefix=prefix)
                )

    def _hand_over(self, finished: list[Group]) -> list[Group]:
        """Give ``finished`` to the scoring threads; returns the groups whose scoring is done.

        When the engine has nothing to decode, waits (briefly) for a batch to be scored
        rather than spin. A scoring failure that stops the run is raised here."""
        if finished:
            self._scoring.append((self._scorers.submit(self._score, finished), finished))
        if not self.engine.has_work and self._scoring:
            concurrent.futures.wait(
                [f for f, _ in self._scoring],
                timeout=SCORING_WAIT_S,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        done = [(f, gs) for f, gs in self._scoring if f.done()]
        self._scoring = [(f, gs) for f, gs in self._scoring if not f.done()]
        scored = []
        for future, groups in done:
            future.result()  # RewardFailing, ScoringStopped: as when scoring in this thread
            scored += groups
        return scored

    def _abandon_scoring(self) -> None:
        self.rewards.stop()

    def close(self) -> None:
        """Stop scoring threads and what the reward functions hold (their processes)."""
        if self._scorers is not None:
            self.rewards.stop()
            self._scorers.shutdown(wait=False, cancel_futures=True)
        self.rewards.close()

    def preempt(self) -> list[PartialGroup]:
        """Stop every group in flight and return what each has: finished completions and prefixes.

        The engine is left empty and the groups are forgotten; :meth:`submit` with the result
        continues them (here or on another worker) where they stopped.
        """
        aborted = {res.request_id: res for res in self.engine.abort()}
        partials = []
        for group_id, pending in sorted(self._pending.items()):
            if pending.state == GroupState.SCORING:
                # Complete: its rewards are computed again after the resume.
                samples = {
                    k: replace(s, reward=None, reward_error=None, reward_components=None)
                    for k, s in pending.samples.items()
                }
                partials.append(PartialGroup(group_id, pending.prompt, samples, pending.pivot))
                continue
            samples = dict(pending.samples)
            for k in range(pending.size):
                res = aborted.get(f"{group_id}/{k}")
                if res is not None and res.completion_ids:
                    samples[k] = Sample(
                        **vars(res.tokens()),
                        prompt_id=pending.prompt.prompt_id,
                        group_id=group_id,
                        prompt_ids=list(pending.prompt_ids),
                        loss_mask=[1] * res.num_completion_tokens,
                        finish_reason="abort",
                        prompt_routes=res.prompt_routes,
                    )
            partials.append(PartialGroup(group_id, pending.prompt, samples, pending.pivot))
        self._scoring = []
        self._pending.clear()
        self._sampling.clear()
        self._complete_now.clear()
        return partials

    def _budgets(self, prompt: Prompt) -> list[int]:
        """Token budget of each of the G completions, never above the configured one.

        A dataset row may set ``max_new_tokens`` for its prompt (one integer) or for each
        completion (a list of G integers), e.g. for curricula or straggler benchmarks.
        """
        cap = self.sampling.max_new_tokens
        value = prompt.extra.get("max_new_tokens")
        if value is None:
            return [cap] * self.group_size
        values = value if isinstance(value, list) else [value] * self.group_size
        if len(values) != self.group_size or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values
        ):
            raise DatasetError(
                f"prompt {prompt.prompt_id}: 'max_new_tokens' must be a positive integer or a list of "
                f"{self.group_size} of them (one per completion), got {value!r}"
            )
        return [min(v, cap) for v in values]

    def step(self, admit: bool = True) -> tuple[list[Group], list[Group]]:
        """Advance the engine one step; returns (completed groups, groups dropped for reward errors).

        ``admit=False`` lets only the running sequences advance (draining before an update).
        """
        if self.abandoned:
            return [], []
        complete, self._complete_now = self._complete_now, []
        for res in self.engine.step(admit=admit):
            self._sampling.pop(res.request_id, None)
            group_id, k = (int(x) for x in res.request_id.split("/", 1))
            pending = self._pending[group_id]
            pending.samples[k] = self._sample(
                pending.prompt, group_id, pending.prompt_ids, res, pending.pivot
            )
            if len(pending.samples) == pending.size:
                complete.append(group_id)
        groups = []
        for group_id in complete:
            pending = self._pending.get(group_id)
            if pending is None:  # cancelled as stale meanwhile
                continue
            pending.state = GroupState.SCORING
            groups.append(
                Group(
                    group_id, pending.prompt, [pending.samples[i] for i in range(pending.size)], pending.pivot
                )
            )
        if self._scorers is None:
            self._score(groups)
        else:
            groups = self._hand_over(groups)
        for group in groups:  # scored: returned, and forgotten here
            del self._pending[group.group_id]
        return self.stats.admit(groups, self.reward_on_error)

    def abort_and_resume(self, before_resume: Callable[[], None] | None = None) -> int:
        """Stop every request in flight, call ``before_resume`` (e.g. load new weights), then
        resume each one from its prefix; returns how many were interrupted.

        A resumed completion keeps the tokens, log-probs and versions of its prefix and
        continues with the same seed, so the final sample is one sequence whose tokens record
        the versions that produced them.
        """
        aborted = self.engine.abort()
        try:
            if before_resume is not None:
                before_resume()
        finally:  # the requests go on (under the old weights) even if the update failed
            for res in aborted:
                self.engine.add_request(resume_request(res, self._sampling[res.request_id]))
        return len(aborted)

    def cancel_stale(self, oldest: Versions) -> Work:
        """Cancel groups whose oldest token is older than ``oldest`` (of the one policy completions have).

        Their requests leave the engine and the group is forgotten; the caller re-issues the
        returned prompts, so nothing is lost.
        """
        running = self.engine.oldest_versions()
        cancelled = []
        for group_id, pending in list(self._pending.items()):
            if pending.state != GroupState.GENERATING or pending.pivot is not None:
                # Complete: the buffer judges it when it is trained. A branch group's prefix is old
                # by design: the controller judges it by its pivot's version, at issue and at training.
                continue
            ids = [f"{group_id}/{k}" for k in range(pending.size)]
            versions = [running[r] for r in ids if r in running]
            versions += [min(s.versions) for s in pending.samples.values() if s.versions]
            if versions and min(versions) < oldest_for(oldest, DEFAULT_POLICY):
                self.engine.abort(ids)
                for r in ids:
                    self._sampling.pop(r, None)
                del self._pending[group_id]
                cancelled.append((group_id, pending.prompt))
        return cancelled

    def _sample(
        self,
        prompt: Prompt,
        group_id: int,
        prompt_ids: list[int],
        res: GenerationResult,
        pivot: Pivot | None = None,
    ) -> Sample:
        """A finished completion; of a branch group (``pivot``), its prefix is out of the loss."""
        ids = res.completion_ids
        start = 0 if pivot is None else pivot.position
        answer_len, finish = len(ids), res.finish_reason
        if self.eos_after is not None and self.eos_after in ids:
            # Generation went on past EOS only to load the engine (decode_past_eos): the answer ends
            # at the first EOS, and the tokens after it are neither scored nor trained.
            answer_len, finish = ids.index(self.eos_after) + 1, "stop"
        text = self.tokenizer.decode(
            [t for t in ids[:answer_len] if t not in self.eos_ids], skip_special_tokens=True
        )
        return Sample(
            **vars(res.tokens()),
            prompt_id=prompt.prompt_id,
            group_id=group_id,
            prompt_ids=list(prompt_ids),
            loss_mask=[0] * start + [1] * (answer_len - start) + [0] * (len(ids) - answer_len),
            finish_reason=finish,
            completion_text=text,
            prompt_routes=res.prompt_routes,
        )

    def _score(self, groups: list[Group]) -> None:
        """Rewards of whole groups, scored as one batch; a failed reward is recorded per sample
        (see ``reward_on_error``)."""
        if not groups:
            return
        batch: list[GroupToScore] = []
        for group in groups:
            ids = [s.completion_ids[: _answer_end(s)] for s in group.samples]
            texts = [s.completion_text for s in group.samples]
            if self.step_delimiter is None:
                batch.append((group.prompt, texts, ids))
                continue
            steps = []
            for sample, answer in zip(group.samples, ids, strict=True):
                sample.turn_spans, step_texts = cut_steps(
                    answer, self.tokenizer, self.step_delimiter, self.eos_ids
                )
                steps.append(step_texts)
            batch.append((group.prompt, texts, ids, {"completion_steps": steps}))
        scored = self.rewards.score_groups(batch)
        for group, results in zip(groups, scored, strict=True):
            for sample, result in zip(group.samples, results, strict=True):
                reward, error = result.reward, result.error
                if self.step_delimiter is not None:
                    steps = result.steps if error is None else None
                    sample.turn_rewards, step_error = _step_rewards(
                        steps, sample.turn_spans, self.step_delimiter
                    )
                    error = error or step_error
                if error is not None:
                    self.stats.reward_errors += 1
                    reward = 0.0 if self.reward_on_error == "zero" else None
                sample.reward, sample.reward_error = reward, error
                sample.reward_components = result.components


def _answer_end(sample: Sample) -> int:
    """Where a completion's answer ends: after its last trained token (generation may go on past EOS,
    untrained; a branch's prefix, before its trained tokens, is part of the answer)."""
    return max((t + 1 for t, m in enumerate(sample.loss_mask) if m), default=0)
