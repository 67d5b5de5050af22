"""Seconds until the local runtime's workers are ready, per start method (runtime.start_method).

    python bench/worker_start.py [--generators 1] [--repeats 3]

Each start method is measured in a fresh Python process of its own (so nothing is imported
or started beforehand): the workers of the default example (a trainer and N generators)
are started until every one reports ready, then stopped, ``--repeats`` times in a row. The
first start of a process pays for what the later ones reuse: with ``forkserver`` the server
that imports torch, transformers and asyncrl once; with ``spawn`` nothing carries over, every
worker imports them again. Prints one JSON object: per method, the seconds of every start.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEASURE = """
import json, sys, tempfile, time
from pathlib import Path
from asyncrl.config import load_config
from asyncrl.runtimes.local import LocalRuntime

method, generators, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = load_config(None, ["runtime.kind=local", f"runtime.start_method={method}", f"runtime.generators={generators}"])
seconds = []
for _ in range(repeats):
    with tempfile.TemporaryDirectory() as tmp:
        runtime = LocalRuntime(cfg, Path(tmp))
        t0 = time.perf_counter()
        try:
            runtime.start()
            seconds.append(round(time.perf_counter() - t0, 3))
        finally:
            runtime.stop()
print(json.dumps(seconds))
"""


def measure(method: str, generators: int, repeats: int) -> list[float]:
    repo = str(Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(
            [sys.executable, "-c", MEASURE, method, str(generators), str(repeats)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": repo},
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"bench/worker_start.py: {method} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generators", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    t0 = time.perf_counter()
    result = {"generators": args.generators, "workers": args.generators + 1}
    for method in ("spawn", "forkserver"):
        result[method] = measure(method, args.generators, args.repeats)
    result["bench_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
