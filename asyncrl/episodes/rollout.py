"""Rollout of multi-turn episodes: tasks in, scored groups of episodes out.

:class:`EpisodeRollout` is a :class:`~asyncrl.rollout.base.Rollout`, so a generator runs
episodes exactly as it runs single-turn completions. For each task it runs G episodes; all
episodes run at once as coroutines on one event loop in a background thread. An episode
that asks for a model turn hands a request to the engine, which decodes it in its
continuous batch beside every other episode's turn; an episode that waits on its
environment (a blocking tool in a thread, or an ``async`` one) holds no engine slot, and
the engine goes on decoding the others. A group is complete when its G episodes are; it
is scored and returned like a group of completions.

Episode k of group g has seed ``(run seed, g, k)``: its turns sample with seeds derived
from it and its turn index, and its environment gets it, so an episode does not depend on
which other episodes ran beside it or on when its environment answered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from transformers import PreTrainedTokenizerBase

from asyncrl.engine.embedded import resume_request
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.episodes.client import EpisodeClient, EpisodeTruncated
from asyncrl.episodes.environment import EpisodeFunction
from asyncrl.prompts.chat import encode_prompt
from asyncrl.rollout.base import Rollout, RolloutStats, Work
from asyncrl.types import Group, PartialGroup, Prompt, Sample

# Longest a step waits for an episode to do something when the engine has nothing to decode.
IDLE_WAIT_S = 0.05
CLOSE_TIMEOUT_S = 10.0  # for cancelled episodes to unwind when the worker closes


@dataclass
class EpisodeStats(RolloutStats):
    episodes: int = 0
    truncated: int = 0
    turns: int = 0
    episode_errors: int = 0


@dataclass
class _PendingGroup:
    prompt: Prompt
    prompt_ids: list[int]
    clients: dict[int, EpisodeClient] = field(default_factory=dict)
    futures: dict[int, concurrent.futures.Future] = field(default_factory=dict)
    samples: dict[int, Sample] = field(default_factory=dict)


@dataclass
class _Turn:
    client: EpisodeClient
    future: asyncio.Future
    sampling: SamplingParams


class EpisodeRollout(Rollout):
    """Runs G multi-turn episodes per task on an engine's ``add_request``/``step`` API.

    An episode's reward is its own (its environment's, or what the episode function returns),
    so there is no scoring stage to abandon at a stop: after :meth:`abandon` the rollout only
    stops stepping, and :meth:`preempt` keeps the finished episodes of each group.
    """

    def __init__(
        self,
        engine,
        tokenizer: PreTrainedTokenizerBase,
        episode: EpisodeFunction,
        sampling: SamplingParams,
        group_size: int,
        *,
        max_turns: int,
        max_episode_tokens: int,
        reward_on_error: str = "zero",
        seed: int = 0,
        tool_threads: int = 64,
    ) -> None:
        """``tool_threads``: threads for blocking environment calls (tools), shared by all episodes."""
        super().__init__(group_size, EpisodeStats())
        self.engine = engine
        self.tokenizer = tokenizer
        self.episode = episode
        self.sampling = sampling
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.reward_on_error = reward_on_error
        self.seed = seed
        self.stop_ids = set(sampling.stop_token_ids)
        self._pending: dict[int, _PendingGroup] = {}
        self._turns: dict[str, _Turn] = {}  # request id -> the turn waiting for it
        self._requests: queue.SimpleQueue[tuple[str, GenerationRequest, _Turn]] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._loop = asyncio.new_event_loop()
        # Blocking tools wait in these threads; the default pool (a few per core) would queue
        # the episodes of a batch behind each other.
        self._tools = concurrent.futures.ThreadPoolExecutor(tool_threads, thread_name_prefix="asyncrl-tool")
        self._loop.set_default_executor(self._tools)
        self._thread = threading.Thread(target=self._loop.run_forever, name="asyncrl-episodes", daemon=True)
        self._thread.start()

    # -- the rollout interface -----------------------------------------------------------------

    @property
    def groups_in_flight(self) -> int:
        return len(self._pending)

    @property
    def has_work(self) -> bool:
        """Whether an episode is running: on the engine, or waiting on its environment."""
        return bool(self._pending) and not self.abandoned

    def encode(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def submit(self, work: Work, partials: dict[int, PartialGroup] | None = None) -> None:
        """Start G episodes for each (group_id, task); a group in ``partials`` (see
        :meth:`preempt`) keeps its finished episodes and starts only the others."""
        partials = partials or {}
        for group_id, prompt in work:
            if group_id in self._pending:
                raise ValueError(f"group {group_id} is already in flight")
            pending = _PendingGroup(prompt, self.encode(prompt))
            partial = partials.get(group_id)
            if partial is not None:
                pending.samples = {k: s for k, s in partial.samples.items() if s.finish_reason != "abort"}
            self._pending[group_id] = pending
            if len(pending.samples) == self.group_size:
                self._finished.put((group_id, -1))  # complete already: returned by the next step
            for k in range(self.group_size):
                if k in pending.samples:
                    continue
                client = EpisodeClient(
                    f"{group_id}/{k}",
                    pending.prompt_ids,
                    seed=(self.seed << 40) + group_id * self.group_size + k,
                    version=self.engine.version,
                    max_turns=self.max_turns,
                    max_episode_tokens=self.max_episode_tokens,
                    max_turn_tokens=self.sampling.max_new_tokens,
                    submit=self._submit_turn,
                    encode_observation=lambda text, p=prompt: self.observation_ids(p, text),
                    decode=self._decode_turn,
                )
                pending.clients[k] = client
                future = asyncio.run_coroutine_threadsafe(self.episode(client, prompt), self._loop)
                future.add_done_callback(lambda _, g=group_id, k=k: self._episode_done(g, k))
                pending.futures[k] = future

    def step(self, admit: bool = True) -> tuple[list[Group], list[Group]]:
        """Hand new turns to the engine, advance it one step, give finished turns back to their
        episodes, and collect finished episodes; returns (completed groups, dropped groups)."""
        if self.abandoned:
            return [], []
        self._take_requests()
        if self.engine.has_work:
            for res in self.engine.step(admit=admit):
                turn = self._turns.pop(res.request_id)
                self.stats.turns += 1
                self._loop.call_soon_threadsafe(_resolve, turn.future, res)
        elif self._finished.empty():
            # Every episode waits on its environment: wait for one to come back (bounded).
            self._wake.wait(IDLE_WAIT_S)
        self._wake.clear()
        return self._collect()

    def abort_and_resume(self, before_resume: Callable[[], None] | None = None) -> int:
        """Stop every turn in flight, call ``before_resume``, then resume each turn from its prefix."""
        aborted = self.engine.abort()
        try:
            if before_resume is not None:
                before_resume()
        finally:
            for res in aborted:
                self.engine.add_request(resume_request(res, self._turns[res.request_id].sampling))
        return len(aborted)

    def preempt(self) -> list[PartialGroup]:
        """Stop every group in flight; returns each group's finished episodes. An episode still
        running is not kept: its environment's state cannot be saved, so after a resume it is
        played again from the start."""
        self._take_requests()
        partials = []
        for group_id, pending in sorted(self._pending.items()):
            partials.append(PartialGroup(group_id, pending.prompt, dict(pending.samples)))
            self._cancel(group_id)
        return partials

    def cancel_stale(self, version: int, max_staleness: int) -> Work:
        """Cancel groups holding a token more than ``max_staleness`` versions behind ``version``."""
        self._take_requests()
        running = self.engine.oldest_versions()
        cancelled = []
        for group_id, pending in list(self._pending.items()):
            versions = [v for r, v in running.items() if r.startswith(f"{group_id}/")]
            for client in pending.clients.values():
                versions += client.record.tokens.versions[:1]
            versions += [min(s.versions) for s in pending.samples.values() if s.versions]
            if versions and version - min(versions) > max_staleness:
                self._cancel(group_id)
                cancelled.append((group_id, pending.prompt))
        return cancelled

    def _abandon_scoring(self) -> None:
        # Nothing is scored apart from the episodes themselves, and a step that waits on the
        # environments does so for at most IDLE_WAIT_S. (No event is set here: this may run in a
        # signal handler, which must not take a lock the interrupted thread may hold.)
        return

    def close(self) -> None:
        """Cancel the episodes still running and stop their event loop."""
        if not self._thread.is_alive():
            return
        for group_id in list(self._pending):
            self._cancel(group_id)
        # An episode that ignores cancellation is left to the daemon thread.
        with contextlib.suppress(concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop).result(timeout=CLOSE_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()  # else the loop still runs in the blocked thread: left to it
        self._tools.shutdown(wait=False, cancel_futures=True)

    # -- observations ---------------------------------------------------------------------------

    def observation_ids(self, prompt: Prompt, text: str) -> list[int]:
        """An observation's tokens (see :func:`observation_ids`)."""
        return observation_ids(self.tokenizer, prompt, text)

    # -- internals ------------------------------------------------------------------------------

    def _submit_turn(self, client: EpisodeClient, context: list[int], budget: int, turn: int):
        """Runs on the episode loop: queue the turn's request for the engine's thread."""
        sampling = replace(self.sampling, max_new_tokens=budget)
        # Each turn its own stream of draws: the episode seed mixed with the turn index.
        seed = (client.seed * 1_000_003 + turn) % (1 << 62)
        request_id = f"{client.name}/{turn}"
        future = self._loop.create_future()
        request = GenerationRequest(request_id, context, sampling, seed=seed)
        self._requests.put((request_id, request, _Turn(client, future, sampling)))
        self._wake.set()
        return future

    def _take_requests(self) -> None:
        while True:
            try:
                request_id, request, turn = self._requests.get_nowait()
            except queue.Empty:
                return
            group_id = int(request_id.split("/", 1)[0])
            if group_id not in self._pending:  # the group was cancelled meanwhile
                continue
            self._turns[request_id] = turn
            self.engine.add_request(request)

    def _decode_turn(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.stop_ids], skip_special_tokens=True)

    def _episode_done(self, group_id: int, k: int) -> None:
        self._finished.put((group_id, k))
        self._wake.set()

    def _cancel(self, group_id: int) -> None:
        pending = self._pending.pop(group_id)
        ids = [r for r in self._turns if r.startswith(f"{group_id}/")]
        self.engine.abort(ids)
        for r in ids:
            turn = self._turns.pop(r)
            self._loop.call_soon_threadsafe(turn.future.cancel)
        for future in pending.futures.values():
            future.cancel()

    def _collect(self) -> tuple[list[Group], list[Group]]:
        complete = []
        while True:
            try:
                group_id, k = self._finished.get_nowait()
            except queue.Empty:
                break
            pending = self._pending.get(group_id)
            if pending is None:  # cancelled
                continue
            if k >= 0:
                pending.samples[k] = self._sample(group_id, pending, k)
            if len(pending.samples) < self.group_size:
                continue
            del self._pending[group_id]
            complete.append(
                Group(group_id, pending.prompt, [pending.samples[i] for i in range(self.group_size)])
            )
        return self.stats.admit(complete, self.reward_on_error)

    def _sample(self, group_id: int, pending: _PendingGroup, k: int) -> Sample:
        future, record = pending.futures[k], pending.clients[k].record
        reward, error = None, None
        try:
            value = future.result(timeout=0)
            reward = sum(r for r in record.turn_rewards if r is not None) if value is None else float(value)
        except EpisodeTruncated:
            reward = sum(r for r in record.turn_rewards if r is not None)
        except Exception as exc:  # agent or environment code failed: recorded like a reward error
            name = getattr(self.episode, "__name__", type(self.episode).__name__)
            error = f"episode function {name} raised {type(exc).__name__}: {exc}"
            self.stats.episode_errors += 1
            self.stats.reward_errors += 1
            reward = 0.0 if self.reward_on_error == "zero" else None
        self.stats.episodes += 1
        self.stats.truncated += record.truncated
        return Sample(
            **vars(record.tokens),
            prompt_id=pending.prompt.prompt_id,
            group_id=group_id,
            prompt_ids=list(pending.prompt_ids),
            loss_mask=record.loss_mask,
            finish_reason="length" if record.truncated else "stop",
            completion_text=self.tokenizer.decode(record.tokens.completion_ids, skip_special_tokens=True),
            reward=reward,
            reward_error=error,
            turn_spans=record.turn_spans,
            turn_rewards=record.turn_rewards,
        )


def observation_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, text: str) -> list[int]:
    """An observation's tokens: for a conversational task, a user turn in the chat
    template's format (what the template puts between an assistant turn and the next
    generation prompt); otherwise the text itself."""
    if prompt.messages is None:
        return tokenizer(text, add_special_tokens=False).input_ids
    before = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
    head = tokenizer.apply_chat_template(before, tokenize=False)
    full = tokenizer.apply_chat_template(
        [*before, {"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    if not full.startswith(head):
        raise ValueError("the chat template renders a conversation differently once it goes on")
    turn = full[len(head) :]
    # The model's own turn already ended with its end-of-turn token (sampled, trained).
    eos = tokenizer.eos_token
    if eos and head.rstrip().endswith(eos) and turn.startswith("\n"):
        turn = turn[1:]
    return tokenizer(turn, add_special_tokens=False).input_ids


def _resolve(future: asyncio.Future, result: GenerationResult) -> None:
    if not future.done():
        future.set_result(result)


async def _cancel_tasks() -> None:
    """Cancel every other task on the running loop and wait for them to unwind."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
