"""The per-step metrics record, computed the same way by every schedule."""

from __future__ import annotations

import statistics
import time

from asyncrl.config import DEFAULT_POLICY
from asyncrl.control.books import Books
from asyncrl.control.buffer import RolloutBuffer
from asyncrl.control.membership import TRAINER, Generators
from asyncrl.protocol.headers import GroupHeader
from asyncrl.protocol.messages import Span, StepDone, WeightsLoaded
from asyncrl.reports.timeline import busy_fractions
from asyncrl.types import Versions

SPAN_MEMORY_S = 60.0  # spans older than this are forgotten (a step's window is shorter)


def batch_metrics(groups: list[GroupHeader], trained_by: Versions) -> dict[str, float]:
    """Reward and staleness statistics of the groups trained in one step, from their headers.

    Staleness of a token is ``trained_by[p] - versions[t]``: how many optimizer steps its policy
    p took between sampling the token and training on it (trained tokens only), ``trained_by``
    being each trained policy's clock that trained the step (a policy missing from it, frozen,
    is left out).
    """
    rewards = [r for g in groups for r in g.rewards if r is not None]
    lags = [
        (by - v, n)
        for g in groups
        for i, counts in enumerate(g.trained_versions)
        for by in [trained_by.get(g.policy_of(i))]
        if by is not None
        for v, n in counts.items()
    ]
    trained = sum(n for _, n in lags)
    lengths = [n for g in groups for n in g.lengths]
    reasons = [r for g in groups for r in g.finish_reasons]
    solved = [[(r or 0) > 0 for r in g.rewards] for g in groups]
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "groups": len(groups),
        "samples": len(lengths),
        "tokens_generated": sum(lengths),
        "completion_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "truncated_frac": sum(r == "length" for r in reasons) / max(len(reasons), 1),
        "reward_errors": sum(g.reward_errors for g in groups),
        # Groups with at least one sample rewarded above 0, and with every sample so rewarded.
        "any_solved_frac": sum(any(g) for g in solved) / max(len(groups), 1),
        "all_solved_frac": sum(all(g) for g in solved if g) / max(len(groups), 1),
        "staleness_mean": sum(lag * n for lag, n in lags) / trained if trained else 0.0,
        "staleness_max": max((lag for lag, n in lags if n), default=0),
        **reward_components(groups),
        **tool_metrics(groups),
    }


def tool_metrics(groups: list[GroupHeader]) -> dict[str, float]:
    """Tool-calling episodes (episode.tools): calls per episode, and the fraction that failed."""
    counts = [c for g in groups for c in g.tool_calls or ()]
    if not counts:
        return {}
    calls = sum(n for n, _ in counts)
    return {
        "tool_calls_mean": calls / len(counts),
        "tool_failure_frac": sum(f for _, f in counts) / calls if calls else 0.0,
    }


def reward_components(groups: list[GroupHeader]) -> dict[str, float]:
    """``reward/<label>``: each reward function's mean unweighted value over the samples it applied to."""
    values: dict[str, list[float]] = {}
    for g in groups:
        for label, per_sample in g.reward_components.items():
            values.setdefault(label, []).extend(v for v in per_sample if v is not None)
    return {f"reward/{label}": statistics.fmean(v) if v else float("nan") for label, v in values.items()}


class StepRecorder:
    """The loop's own measurements between two steps: busy fractions, tokens/s, weight-sync time."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.last_step_end = time.time()
        self.tokens_since_step = 0
        self.sync_load_s: dict[int, list[float]] = {}  # generators' load times, by version

    def on_span(self, span: Span) -> None:
        self.spans.append(span)

    def on_generated(self, tokens: int) -> None:
        self.tokens_since_step += tokens

    def on_loaded(self, event: WeightsLoaded) -> None:
        self.sync_load_s.setdefault(event.version, []).append(event.seconds)

    def record(
        self,
        event: StepDone,
        groups: list[GroupHeader],
        generators: list[str],
        extra: dict,
        trained_by: Versions | None = None,
    ) -> dict:
        """The step's metrics.jsonl row: the batch's metrics, the trainer's, the loop's own, then ``extra``.

        ``trained_by``: with several policies, the clocks that trained the step (see :func:`batch_metrics`).
        """
        now = time.time()
        busy = busy_fractions([s.__dict__ for s in self.spans], self.last_step_end, now) if self.spans else {}
        gen_busy = [busy.get(g, 0.0) for g in generators]
        self.spans = [s for s in self.spans if s.end > now - SPAN_MEMORY_S]
        elapsed = max(now - self.last_step_end, 1e-9)
        record = {
            **(
                batch_metrics(
                    groups, {DEFAULT_POLICY: event.version - 1} if trained_by is None else trained_by
                )
                if groups
                else {}
            ),
            **event.metrics,
            "policy_version": event.version,
            "trainer_busy_frac": busy.get(TRAINER, 0.0),
            "generator_busy_frac": sum(gen_busy) / max(len(gen_busy), 1),
            "weight_sync_s": event.publish_s + max(self.sync_load_s.get(event.version - 1, [0.0])),
            "tokens_per_s": self.tokens_since_step / elapsed,  # generated since the last step
            **extra,
        }
        record["trained_tokens_per_s"] = record.get("trained_tokens", 0) / elapsed
        self.tokens_since_step = 0
        self.last_step_end = now
        return record


def loop_figures(books: Books, buffer: RolloutBuffer, generators: Generators) -> dict[str, float]:
    """The controller loop's own figures of a step record: drops, the buffer's depth, time blocked
    by admission, the oldest weights a generator holds, what a resume carried, and the features'
    (e.g. the teacher's queue)."""
    counts = books.counts
    return {
        "dropped": books.dropped_total,
        "buffer_depth": len(buffer),
        **books.features.loop_figures(),
        "admission_blocked_s": books.admission_blocked_s,
        "gen_version_min": min(generators.version.values(), default=-1),  # -1: none right now
        # After a resume: what it carried over, and what was generated again instead.
        **{k: v for k, v in counts.items() if k.startswith(("carried_", "discarded_"))},
    }
