"""The panels of a run report: which metrics each draws, under which title.

The core's panels (:data:`PANELS`: reward, loss, KL, staleness, throughput, ...) are listed
here; a feature that logs metrics of its own registers its panels in :data:`REPORT_PANELS`
(the shipped features do so in :mod:`asyncrl.features.report_panels`), and a report draws them
after the core's, in the order they were registered, when a run logged their metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.plugins import Registry


@dataclass(frozen=True)
class Panel:
    slug: str  # the PNG's name; unique among the panels
    title: str
    keys: tuple[str, ...]  # metric names; a pattern with "*" (fnmatch) stands for every name it matches
    ylabel: str = ""
    source: str = "metrics"  # or "eval"


PANELS = (
    Panel("reward", "Reward (mean per step)", ("reward_mean",), "reward"),
    Panel("reward_functions", "Reward per reward function", ("reward/*",), "unweighted value"),
    Panel("eval_accuracy", "Eval accuracy (held-out; best of N with N samples)", ("eval_accuracy", "eval_best_of_n"), "mean reward", "eval"),
    Panel("eval_by", "Eval accuracy per value of run.eval_by", ("eval_accuracy/*",), "mean reward", "eval"),
    Panel("loss", "Loss", ("loss",)),
    Panel("kl", "KL", ("kl_ref", "mismatch_kl"), "nats/token"),
    Panel("entropy", "Entropy", ("entropy",), "nats/token"),
    Panel("clip_frac", "Clip fraction", ("clip_frac",), "fraction of tokens"),
    Panel("staleness", "Staleness", ("staleness_mean", "staleness_max"), "policy versions"),
    Panel(
        "is_weights", "Importance-sampling weights", ("is_weight_mean", "is_weight_max", "is_clipped_frac")
    ),
    Panel("tokens_per_s", "Tokens/s: generated, trained", ("tokens_per_s", "trained_tokens_per_s"), "tokens/s"),
    Panel(
        "busy", "Generator / trainer busy", ("generator_busy_frac", "trainer_busy_frac"), "fraction of time"
    ),
    Panel("dropped", "Groups dropped (in all) and buffered", ("dropped", "buffer_depth"), "groups"),
)  # fmt: skip

# A feature's panels, drawn when a run logged their metrics; registered under their slugs by
# the one light module that fills this registry (a report imports no model code).
REPORT_PANELS: Registry[Panel] = Registry("report panel", filled_by=("asyncrl.features.report_panels",))


def report_panels() -> list[Panel]:
    """The core's panels, then every registered feature's; a slug taken twice is refused."""
    out = [*PANELS, *(panel for _, panel in REPORT_PANELS.entries())]
    slugs = [p.slug for p in out]
    twice = sorted({s for s in slugs if slugs.count(s) > 1})
    if twice:
        raise ValueError(f"report panels {twice} are given twice: a panel's slug names its PNG")
    return out
