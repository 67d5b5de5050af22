"""Bytes through the controller: what the controller process receives and sends per optimizer step.

    python bench/controller_bytes.py [--steps 8] [--tokens 16 256] [--schedule async]

Runs ``asyncrl train`` in the local runtime (every worker in its own process, so each event
really crosses a process boundary) and measures, with the events' pickled sizes, every
event the controller receives and every command it sends, by type. Two workloads: the
built-in arithmetic task as shipped, and the same task with completions forced to
``--tokens`` tokens (EOS ignored), so a payload that grows with the rollouts shows up.

Prints one JSON object (last line): per workload, ``received_bytes_per_step``,
``sent_bytes_per_step``, ``received_bytes_per_group`` (GroupReady events only) and the
bytes by event and command type.
"""

from __future__ import annotations

import argparse
import json
import pickle
import tempfile
from collections import Counter
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.control.controller import Controller
from asyncrl.control.run import train


class ByteCounter:
    """Wraps the controller's event handler and command sender to count pickled bytes by type."""

    def __init__(self) -> None:
        self.received: Counter = Counter()
        self.sent: Counter = Counter()
        self.groups = 0

    def install(self):
        on_event, send = Controller._on_event, Controller._send
        counter = self

        def counted_on_event(controller, event):
            name = type(event).__name__
            counter.received[name] += len(pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL))
            counter.groups += name == "GroupReady"
            return on_event(controller, event)

        def counted_send(controller, worker, command):
            counter.sent[type(command).__name__] += len(
                pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
            )
            return send(controller, worker, command)

        Controller._on_event, Controller._send = counted_on_event, counted_send
        return lambda: (setattr(Controller, "_on_event", on_event), setattr(Controller, "_send", send))


def measure(overrides: list[str], steps: int, work: Path, tag: str) -> dict:
    counter = ByteCounter()
    restore = counter.install()
    try:
        train(load_config(None, [*overrides, f"run.steps={steps}"]), work / tag)
    finally:
        restore()
    received, sent = sum(counter.received.values()), sum(counter.sent.values())
    return {
        "steps": steps,
        "groups_received": counter.groups,
        "received_bytes_per_step": received / steps,
        "sent_bytes_per_step": sent / steps,
        "received_bytes_per_group": counter.received["GroupReady"] / max(counter.groups, 1),
        "received_by_type": dict(counter.received.most_common()),
        "sent_by_type": dict(counter.sent.most_common()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="*", default=[256], help="forced completion lengths")
    parser.add_argument("--schedule", default="async")
    args = parser.parse_args()
    base = [
        f"schedule={args.schedule}",
        "runtime.kind=local",
        "run.eval_every=0",
        "run.progress=false",
        "run.checkpoint_every=0",
    ]
    results = {}
    with tempfile.TemporaryDirectory(prefix="asyncrl-controller-bytes-") as tmp:
        work = Path(tmp)
        results["arith"] = measure(base, args.steps, work, "arith")
        for tokens in args.tokens:
            forced = [*base, "rollout.ignore_eos=true", f"rollout.max_new_tokens={tokens}"]
            results[f"arith_{tokens}_tokens"] = measure(forced, args.steps, work, f"forced-{tokens}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
