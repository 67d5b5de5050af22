"""Shared fixtures (seeded tiny policies, a Sample factory) and session hooks: the local runtime's
fork server started with the session, GPU skips, and test outcomes printed as they end on CUDA."""

from __future__ import annotations

import importlib.util
import multiprocessing.forkserver
import os
from collections.abc import Callable, Iterator

import pytest
import torch

from asyncrl.models.loading import Policy, load_policy
from asyncrl.runtimes.processes import worker_context
from asyncrl.types import Sample

# The processes the tests start (workers, `asyncrl serve`, reward and helper processes) inherit
# this: torch in them starts with one intra-op thread, as this process runs (_single_thread),
# unless the code sets a count itself. On a few small cores, idle OpenMP threads of every child
# would otherwise spin for work (test_server's two servers took 36 s of CPU with two threads
# each, 12 s with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``vllm`` are skipped, with the reason, where vLLM is not installed (the vLLM
    tier installs it). Tests marked ``gpu`` are skipped, with the reason, where no CUDA device is
    visible (``ASYNCRL_GPU_TESTS_ON_CPU=1`` runs them on the CPU instead, see tests/test_gpu.py).

    On CUDA, tests/test_gpu.py's end-to-end runs (12 to 19 s each, mostly process start-up) go
    after every other test: a GPU check with a time limit then cuts them, not the short tests of
    the other files (an H100 check ran out of time inside test_gpu.py before reaching them).

    Ray tests share one group (``xdist_group``): with ``-n N --dist loadgroup`` one worker runs them."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            # Under pytest-xdist (-n N --dist loadgroup) every Ray test runs on one worker, one
            # after another: a Ray instance started beside another on a small machine slows both
            # past their waits' bounds.
            item.add_marker(pytest.mark.xdist_group("ray"))
    if importlib.util.find_spec("vllm") is None:
        no_vllm = pytest.mark.skip(
            reason="needs vLLM (not installed); the vLLM tier's command is in the README"
        )
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(no_vllm)
    if torch.cuda.is_available():
        items.sort(key=lambda item: item.path.name == "test_gpu.py")  # stable: order kept within
    if torch.cuda.is_available() or os.environ.get("ASYNCRL_GPU_TESTS_ON_CPU") == "1":
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA device (none is visible); run `python -m pytest -m gpu` on a GPU"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On a CUDA machine, each test's outcome and time as it ends, and a failure's report at
    once: a GPU check cut off at its time limit never reaches pytest's closing summary."""
    terminal = _config and _config.pluginmanager.get_plugin("terminalreporter")
    if terminal is None or not torch.cuda.is_available():
        return
    if report.when == "call" or report.failed:
        terminal.write_line(
            f"\n[gpu test] {report.nodeid} {report.when}: {report.outcome} in {report.duration:.1f} s"
        )
    if report.failed:
        terminal.write_line(report.longreprtext[-4000:])


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the local runtime's fork server (runtime.start_method=forkserver) now: it imports
    torch, transformers and asyncrl's workers on another core while the tests are collected,
    instead of during the first test that starts a local run. Under pytest-xdist only the
    workers, which run the tests, start one; the process that hands them out does not."""
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        return
    worker_context("forkserver")  # sets what the server preloads
    multiprocessing.forkserver.ensure_running()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the fork server with the session rather than leave it to end with the interpreter."""
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)  # CPython's own teardown
    if stop is not None:
        stop()


@pytest.fixture(autouse=True, scope="session")
def _single_thread() -> Iterator[None]:
    """One intra-op thread, so reductions run in one order and results repeat exactly."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def tiny_policy() -> Policy:
    """A fresh randomly initialised ``tiny:1m`` (qwen2) policy on CPU, float32, seed 0."""
    return load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)


def build_sample(
    prompt_ids: list[int],
    completion_ids: list[int],
    *,
    logprobs: list[float] | None = None,
    versions: list[int] | None = None,
    loss_mask: list[int] | None = None,
    advantage: float | None = None,
    reward: float | None = None,
    prompt_id: str = "p0",
    group_id: int = 0,
    finish_reason: str = "length",
) -> Sample:
    n = len(completion_ids)
    return Sample(
        prompt_id=prompt_id,
        group_id=group_id,
        prompt_ids=list(prompt_ids),
        completion_ids=list(completion_ids),
        logprobs=[0.0] * n if logprobs is None else list(logprobs),
        versions=[0] * n if versions is None else list(versions),
        loss_mask=[1] * n if loss_mask is None else list(loss_mask),
        finish_reason=finish_reason,  # type: ignore[arg-type]
        reward=reward,
        advantage=advantage,
    )


@pytest.fixture
def make_sample() -> Callable[..., Sample]:
    """A factory for Samples; per-token fields default to logprob 0, version 0, mask 1."""
    return build_sample
