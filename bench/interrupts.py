"""What each interrupt mode does to sequences in flight, drawn step by step.

    python bench/interrupts.py [--plot docs/img/interrupt-modes.png]

A generator (tiny 1M model, EOS ignored so every completion runs to its budget) starts
four sequences with budgets of 12, 20, 28 and 36 tokens. After 8 engine steps, weights of
version 1 are published and two more prompts are submitted. For each interrupt mode the
script records at which step every token was produced and by which policy version, prints
one JSON object (per mode: the step at which the update landed, per sequence the tokens
of each version and the step it finished), and draws one panel per mode.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from asyncrl.config import load_config
from asyncrl.protocol.messages import GroupReady, LoadWeights, Submit, WeightsLoaded
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.types import Prompt
from asyncrl.workers.generator import GeneratorWorker

BUDGETS = [12, 20, 28, 36]
LATE_BUDGETS = [10, 10]
UPDATE_AT = 8
MEANING = {
    "never": "sequences continue on their KV cache",
    "abort": "sequences stop, prefixes are re-prefilled under v1, then continue",
    "drain": "nothing new starts until the running sequences end",
    "batch": "the update waits until all submitted work is done",
}


def run_mode(mode: str, jsonl: Path) -> dict:
    cfg = load_config(
        None,
        [
            "model.path=tiny:1m",
            "task.name=jsonl",
            f"task.path={jsonl}",
            "rollout.group_size=1",
            "rollout.max_new_tokens=64",
            "rollout.ignore_eos=true",
            f"schedule.interrupt={mode}",
            "schedule.preset=custom",
            "schedule.max_staleness=4",
            "algorithm.advantage_scale=none",
        ],
    )
    channel = InProcessChannel()
    worker = GeneratorWorker("generator-0", cfg, lambda layout: channel, seed=0)
    prompts = [Prompt(f"p{i}", f"{i}+{i}=", str(2 * i), {"max_new_tokens": b}) for i, b in enumerate(BUDGETS)]
    late = [Prompt(f"q{i}", f"{i}*3=", str(3 * i), {"max_new_tokens": b}) for i, b in enumerate(LATE_BUDGETS)]
    worker.handle(Submit(list(enumerate(prompts))))
    token_steps: dict[str, list[int]] = {}
    finished: dict[str, dict] = {}
    update_step = None
    step = 0
    while not worker.idle or step <= UPDATE_AT:
        if step == UPDATE_AT:
            with torch.no_grad():
                channel.publish(((n, p + 0.01) for n, p in worker.engine.model.named_parameters()), 1)
            worker.handle(LoadWeights(1))
            worker.handle(Submit([(len(prompts) + i, p) for i, p in enumerate(late)]))
        events = worker.work()
        if any(isinstance(e, WeightsLoaded) for e in events):
            update_step = step
        for rid, (tokens, _) in worker.engine.partial().items():
            name = rid.split("/")[0]
            token_steps.setdefault(name, [])
            token_steps[name] += [step] * (len(tokens) - len(token_steps[name]))
        for e in events:
            if isinstance(e, GroupReady):
                s = e.group.samples[0]
                name = str(e.group.group_id)
                token_steps.setdefault(name, [])
                token_steps[name] += [step] * (len(s.completion_ids) - len(token_steps[name]))
                finished[name] = {
                    "prompt": e.group.prompt.prompt_id,
                    "versions": s.versions,
                    "steps": token_steps[name],
                    "finished_at": step,
                }
        step += 1
        if step > 500:
            raise RuntimeError(f"{mode}: did not finish")
    return {"update_applied_at_step": update_step, "sequences": finished}


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.1 * len(results)), sharex=True)
    colors = {0: "#4C72B0", 1: "#DD8452"}
    for ax, (mode, res) in zip(axes, results.items(), strict=True):
        for y, (_, seq) in enumerate(sorted(res["sequences"].items(), key=lambda kv: int(kv[0]))):
            for step, version in zip(seq["steps"], seq["versions"], strict=True):
                ax.barh(y, 1, left=step, color=colors[version], height=0.7, edgecolor="white", linewidth=0.3)
            ax.text(-0.5, y, seq["prompt"], ha="right", va="center", fontsize=7)
        if res["update_applied_at_step"] is not None:
            ax.axvline(res["update_applied_at_step"], color="black", lw=1, ls="--")
        ax.axvline(UPDATE_AT, color="grey", lw=0.8, ls=":")
        ax.set_yticks([])
        ax.set_title(
            f"interrupt={mode}: {MEANING[mode]} — published at step {UPDATE_AT} (dotted), applied at "
            f"step {res['update_applied_at_step']} (dashed)",
            fontsize=9,
            loc="left",
        )
    axes[-1].set_xlabel("engine step (one token per running sequence)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["token from version 0", "token from version 1"], loc="lower right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "unused.jsonl"  # the worker gets its prompts by Submit; the task only has to load
        jsonl.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
        results = {mode: run_mode(mode, jsonl) for mode in ("never", "abort", "drain", "batch")}
    if args.plot:
        plot(results, args.plot)
    summary = {
        mode: {
            "update_applied_at_step": res["update_applied_at_step"],
            "sequences": {
                seq["prompt"]: {
                    "v0_tokens": seq["versions"].count(0),
                    "v1_tokens": seq["versions"].count(1),
                    "finished_at": seq["finished_at"],
                }
                for seq in res["sequences"].values()
            },
        }
        for mode, res in results.items()
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
