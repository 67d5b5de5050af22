"""algorithm.mask_truncated: completions cut by their token budget are kept out of the loss."""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.types import Group, Prompt, Sample
from tests.conftest import build_sample
from tests.helpers import short_run


def sample(finish: str, mask: list[int]) -> Sample:
    return build_sample([3], [4] * len(mask), loss_mask=mask, reward=1.0, finish_reason=finish, prompt_id="p")


def test_a_group_masks_only_its_truncated_completions() -> None:
    group = Group(
        0, Prompt("p", "x"), [sample("length", [1, 1, 0]), sample("stop", [1, 1]), sample("length", [0, 0])]
    )
    assert group.mask_truncated() == 1  # the third had nothing left to mask
    assert [s.loss_mask for s in group.samples] == [[0, 0, 0], [1, 1], [0, 0]]
    assert [s.reward for s in group.samples] == [1.0, 1.0, 1.0]  # rewards (and so advantages) stay


def first_step(tmp_path: Path, *extra: str) -> dict:
    """Step 1 of the built-in example (its samples depend only on the starting weights)."""
    cfg = load_config(None, [*short_run(1, prompts=4, group_size=4), "rollout.max_new_tokens=3", *extra])
    summary = train(cfg, tmp_path)
    assert summary["accounting"]["reconciles"] and summary["accounting"]["trained"] == 4
    return json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])


def test_truncated_completions_leave_the_loss_and_the_others_stay(tmp_path: Path) -> None:
    """The same 16 samples with and without the mask: the trained tokens drop by exactly the
    truncated completions' 3 tokens each, and only by them."""
    plain = first_step(tmp_path / "plain")
    masked = first_step(tmp_path / "masked", "algorithm.mask_truncated=true")
    truncated = round(plain["truncated_frac"] * 16)
    assert 0 < truncated < 16 and masked["truncated_frac"] == plain["truncated_frac"]
    assert masked["trained_tokens"] == plain["trained_tokens"] - 3 * truncated
    assert masked["reward_mean"] == plain["reward_mean"]


def test_groups_all_cut_short_are_trained_under_token_rejection(tmp_path: Path) -> None:
    """One new token per completion cuts every completion short, so no group has a trained token.
    Under schedule.reject=token such groups were booked as stale and issued again until the run
    ended naming schedule.max_staleness; they are trained as under reject=group, nothing dropped."""
    overrides = [*short_run(2), "rollout.max_new_tokens=1", "algorithm.mask_truncated=true"]
    for reject in ("group", "token"):
        summary = train(load_config(None, [*overrides, f"schedule.reject={reject}"]), tmp_path / reject)
        books = summary["accounting"]
        assert books["reconciles"] and (books["issued"], books["trained"], books["cancelled_stale"]) == (
            8,
            8,
            0,
        )
        steps = [json.loads(line) for line in (tmp_path / reject / "metrics.jsonl").read_text().splitlines()]
        assert [(s["truncated_frac"], s["trained_tokens"]) for s in steps] == [(1.0, 0)] * 2
