"""The ``asyncrl`` command line end to end: a short training run, user errors, a JSONL task, and ``sft``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncrl.builtin.sft_settings import SFTConfig, sft_config
from asyncrl.builtin.warm_start import run_sft
from asyncrl.cli import main
from asyncrl.config import RolloutConfig, RunConfig, load_config
from asyncrl.models.loading import load_policy
from asyncrl.reports.jsonl import read_jsonl
from tests.helpers import child_env, cli

SHORT = [
    "--set",
    "run.steps=3",
    "--set",
    "rollout.prompts_per_step=4",
    "--set",
    "run.eval_every=3",
    "--set",
    "run.progress=false",
    "--set",
    "runtime.trainer_threads=1",
]
STEP_KEYS = {
    "step",
    "time_s",
    "policy_version",
    "reward_mean",
    "samples",
    "tokens_generated",
    "staleness_mean",
    "staleness_max",
    "dropped",
    "trainer_busy_frac",
    "generator_busy_frac",
    "weight_sync_s",
    "loss",
}


def on_grid(value: float, n: int) -> bool:
    """Whether ``value`` is k/n for an integer 0 <= k <= n, as a mean of n scores each 0 or 1 must be."""
    return 0 <= round(value * n) <= n and abs(value * n - round(value * n)) < 1e-6


def overrides(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--set"]


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, Path]:
    """``asyncrl train`` in-process on the built-in example for 3 steps: (exit code, printed summary, run dir)."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", *SHORT, "--run-dir", str(run_dir)])
    return code, json.loads(out.getvalue().strip().splitlines()[-1]), run_dir


def check_run_dir(
    run_dir: Path, args: list[str], steps: int = 3, samples: int = 32, reward_levels: int = 1
) -> list[dict]:
    """Assert the files of a finished short run and return its metrics records.

    ``reward_levels``: each completion's reward is k/reward_levels (exact match: 0 or 1).
    """
    assert load_config(run_dir / "config.yaml") == load_config(None, overrides(args))
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert len(records) == steps
    for i, r in enumerate(records, start=1):
        assert r.keys() >= STEP_KEYS, STEP_KEYS - r.keys()
        assert r["step"] == r["policy_version"] == i
        assert r["staleness_mean"] == 0.0 and r["staleness_max"] == 0
        assert r["samples"] == samples
        assert r["dropped"] == 0
        assert on_grid(r["reward_mean"], samples * reward_levels)
        assert r["tokens_generated"] >= samples  # at least EOS in every completion
        assert 0.0 < r["generator_busy_frac"] <= 1.0 and 0.0 < r["trainer_busy_frac"] <= 1.0
        assert r["generator_busy_frac"] + r["trainer_busy_frac"] <= 1.0
        assert r["weight_sync_s"] > 0.0  # the sync schedule publishes after every step
    assert [r["time_s"] for r in records] == sorted(r["time_s"] for r in records)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["steps"] == steps
    assert summary["tokens_generated"] == sum(r["tokens_generated"] for r in records)
    assert (run_dir / "final" / "config.json").is_file()
    assert (run_dir / "final" / "tokenizer.json").is_file()
    return records


def test_train_in_process(short_run) -> None:
    """``asyncrl train`` exits 0 and writes a config that re-validates, 3 metrics records, summary, evals, model."""
    code, printed, run_dir = short_run
    assert code == 0
    records = check_run_dir(run_dir, SHORT)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert printed == {k: v for k, v in summary.items() if k != "eval"}
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3]
    assert all(on_grid(e["eval_accuracy"], RunConfig().eval_prompts) for e in evals)
    assert evals[0]["eval_accuracy"] >= 0.7  # builtin:arith greedy is ~0.8 before training
    assert summary["eval"] == evals
    assert summary["reward_first"] == records[0]["reward_mean"]
    assert summary["reward_last"] == records[-1]["reward_mean"]


def test_train_changes_the_weights(short_run) -> None:
    """The final model has the trained weights: different from builtin:arith, same tokenizer."""
    _, _, run_dir = short_run
    final = load_policy(str(run_dir / "final"), device="cpu")
    start = load_policy("builtin:arith", device="cpu")
    assert not same_weights(final.model, start.model)
    assert final.tokenizer("12+7=").input_ids == start.tokenizer("12+7=").input_ids


@pytest.mark.slow  # the same run in-process: test_train_in_process; the program entry point: test_user_error_in_a_subprocess_...
@pytest.mark.multiprocess
def test_train_as_a_subprocess_matches_in_process(short_run, tmp_path: Path) -> None:
    """``python -m asyncrl.cli train`` exits 0, writes the same files, and reproduces the in-process run."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        cli("train", *SHORT, "--run-dir", str(run_dir)),
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(PYTHONHASHSEED="0"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 3
    records = check_run_dir(run_dir, SHORT)
    reference = read_jsonl(short_run[2] / "metrics.jsonl")
    for key in ("reward_mean", "tokens_generated", "samples", "loss"):
        assert [r[key] for r in records] == [r[key] for r in reference], key
    assert (
        read_jsonl(run_dir / "eval.jsonl")[-1]["eval_accuracy"]
        == read_jsonl(short_run[2] / "eval.jsonl")[-1]["eval_accuracy"]
    )


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--set", "trainer.bogus=1"], ["trainer.bogus=1: unknown key; allowed keys here:"]),
        (["--set", "rollout.temperature=0"], ["rollout.temperature=0", "greater than 0"]),
        (["--set", "algorithm.loss_type=ppo"], ["algorithm.loss_type='ppo'", "'dapo'"]),
        (["--set", "run.steps"], ["--set='run.steps'", "expected key=value"]),
        (["{tmp}/missing.yaml"], ["config file '{tmp}/missing.yaml' does not exist"]),
        (["--set", "model.path={tmp}/no_model"], ["model.path='{tmp}/no_model': no such directory"]),
        (
            ["--set", "task.name=jsonl", "--set", "task.path={tmp}/missing.jsonl"],
            ["dataset file '{tmp}/missing.jsonl' does not exist"],
        ),
        (
            ["--set", "task.name=jsonl", "--set", "task.path={tmp}/bad.jsonl"],
            ["{tmp}/bad.jsonl, line 2: missing field(s) ['answer']", "task.skip_bad_rows=true"],
        ),
        (["--set", "task.reward=asyncrl_no_such_module:fn"], ["task.reward=", "cannot import module"]),
        (["--set", "task.name=jsonl", "--set", "task.path={tmp}"], ["dataset file '{tmp}' is a directory"]),
    ],
    ids=[
        "unknown_key",
        "bad_value",
        "bad_literal",
        "no_equals",
        "missing_config",
        "missing_model",
        "missing_dataset",
        "bad_dataset_row",
        "missing_reward",
        "dataset_directory",
    ],
)
def test_user_errors_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], needles: list[str]
) -> None:
    """A user error exits 2 with one ``asyncrl: error:`` line naming the key or file, and no traceback."""
    (tmp_path / "bad.jsonl").write_text(
        '{"prompt": "1+1=", "answer": 2}\n{"prompt": "2+2="}\n', encoding="utf-8"
    )
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    code, err = run_cli(
        ["train", *args, "--set", "run.progress=false", "--run-dir", str(tmp_path / "run")], capsys
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("asyncrl: error: ")
    for needle in needles:
        assert needle.replace("{tmp}", str(tmp_path)) in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--set", "vllm.enforce_eager=true"],
            "--set=['vllm.enforce_eager=true']: asyncrl serve takes settings only",
        ),
        (
            ["--engine", "vllm", "--set", "run.steps=3"],
            "takes vllm.*, rollout.kv_cache_gb and rollout.max_seq_len",
        ),
    ],
    ids=["settings_without_vllm", "a_key_serve_does_not_take"],
)
def test_serve_user_errors_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str], needle: str
) -> None:
    """``asyncrl serve``'s bad settings are one line naming them, before any engine is built (vLLM
    taken as installed here, so that the second check is reached)."""
    from asyncrl.config import engines

    monkeypatch.setattr(engines, "vllm_installed", lambda: True)
    code, err = run_cli(["serve", "--port", "0", *args], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("asyncrl: error: "), err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["serve", "--device", "tpu"],
            "argument --device: 'tpu': expected 'auto', 'cpu', 'cuda' or 'cuda:<index>'",
        ),
        (["serve", "--max-batch-size", "0"], "argument --max-batch-size: '0': at least 1"),
        (["serve", "--max-batch-size", "x"], "argument --max-batch-size: 'x' is not an integer"),
        (["sft", "--out", "unused", "--blur-steps", "-3"], "argument --blur-steps: '-3': at least 0"),
        (
            ["sft", "--out", "unused", "--answer-noise", "2"],
            "argument --answer-noise: '2' is not a fraction from 0 to 1",
        ),
        (
            ["sft", "--out", "unused", "--answer-noise", "nan"],
            "argument --answer-noise: 'nan' is not a fraction",
        ),
    ],
)
def test_flags_out_of_range_are_argparses_error_before_anything_runs(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    """A flag's bad value stops the command at once with argparse's line naming flag and value (a
    device torch does not know was a traceback; a batch of 0 served nothing; a noise of 2 trained)."""
    with pytest.raises(SystemExit) as refused:
        main(args)
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_serve_on_a_port_it_cannot_take_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    """A port out of range is argparse's error before anything loads; a port in use is one line
    naming the address, with the engine loop it had started stopped again (it was a traceback)."""
    with pytest.raises(SystemExit) as out_of_range:
        main(["serve", "--port", "99999"])
    assert out_of_range.value.code == 2
    assert "argument --port: '99999' is not a port (0 to 65535" in capsys.readouterr().err
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = run_cli(["serve", "--port", str(port)], capsys)
    finally:
        taken.close()
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"asyncrl: error: cannot listen on 127.0.0.1:{port} (--host, --port): "), err
    assert "engine-loop" not in [thread.name for thread in threading.enumerate()]


def test_serve_on_vllm_where_it_is_not_installed_says_how_to_install_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from asyncrl.config.engines import vllm_installed

    if vllm_installed():
        pytest.skip("vLLM is installed here")
    code, err = run_cli(["serve", "--port", "0", "--engine", "vllm"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("asyncrl: error: --engine='vllm': vLLM is not installed: ") and "pip install" in err


@pytest.mark.slow  # exit 2 with one line: test_user_errors_exit_2_with_one_line; `python -m asyncrl.cli` as a program: test_stops
@pytest.mark.multiprocess
def test_user_error_in_a_subprocess_has_no_traceback(tmp_path: Path) -> None:
    """Run as a program, a bad key gives exit code 2 and exactly one error line on stderr."""
    proc = subprocess.run(
        cli("config", "--set", "rollout.group_sise=4"),
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("asyncrl: error: rollout.group_sise=4: unknown key; allowed keys here: ")
    allowed = lines[0].split("allowed keys here: ", 1)[1].split(", ")
    assert allowed == sorted(RolloutConfig.model_fields)


def test_jsonl_task_with_user_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSONL task trains 2 steps with a ``module:function`` reward that receives the rows' extra fields."""
    rows = [
        {"prompt": f"{a}+{b}=", "answer": a + b, "level": 1 + (a + b) % 3}
        for a, b in [(3, 4), (12, 7), (5, 5), (40, 2), (9, 9)]
    ]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"prompt": "1+1="}\n', encoding="utf-8")
    (tmp_path / "asyncrl_test_cli_reward.py").write_text(
        textwrap.dedent(
            """
            def graded(completion, prompt, answer, level):
                # No **kwargs: if the row's extra field were not passed, every call would be a recorded error.
                return float(completion.strip() == answer) * level / 3
            """
        ),
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = [
        "--set", "task.name=jsonl",
        "--set", f"task.path={data}",
        "--set", "task.reward=asyncrl_test_cli_reward:graded",
        "--set", "task.skip_bad_rows=true",
        "--set", "rollout.group_size=4",
        "--set", "rollout.prompts_per_step=3",
        "--set", "rollout.max_new_tokens=5",
        "--set", "run.steps=2",
        "--set", "run.eval_every=2",
        "--set", "run.eval_prompts=4",
        "--set", "run.progress=false",
    ]  # fmt: skip
    run_dir = tmp_path / "run"
    assert main(["train", *args, "--run-dir", str(run_dir)]) == 0
    records = check_run_dir(run_dir, args, steps=2, samples=12, reward_levels=3)  # graded: 0, 1/3, 2/3, 1
    for r in records:
        assert r["reward_errors"] == 0
    assert sum(r["reward_mean"] for r in records) > 0  # builtin:arith solves some of these sums
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2]
    assert all(on_grid(e["eval_accuracy"], 3 * 4) for e in evals)  # 4 held-out rows, graded
    # The row without an answer was skipped, and the run said so (once: the held-out rows are the same file's).
    warnings = [e["warning"] for e in read_jsonl(run_dir / "events.jsonl") if "warning" in e]
    assert warnings == [
        f"{data}: skipped 1 of 6 rows (task.skip_bad_rows=true): {data}, line 6: missing field(s) ['answer']; "
        "each row needs ['prompt', 'answer']"
    ]


SFT_TINY = SFTConfig(max_learn_steps=2, blur_steps=2, eval_every=2, eval_prompts=8, batch_size=8)


def test_sft_writes_a_loadable_model_and_summary(tmp_path: Path) -> None:
    """``run_sft`` on a tiny budget writes a loadable model and a summary with accuracies over its 8 held-out prompts."""
    out = tmp_path / "sft"
    summary = run_sft(SFT_TINY, out, log=lambda _: None)
    assert json.loads((out / "sft_summary.json").read_text(encoding="utf-8")) == summary
    assert summary["learn_steps"] == 2
    assert [(h["phase"], h["step"]) for h in summary["history"]] == [("learn", 2), ("blur", 4)]
    for acc in [summary["accuracy_sampled"], summary["accuracy_greedy"]] + [
        h[k] for h in summary["history"] for k in ("accuracy_sampled", "accuracy_greedy")
    ]:
        assert on_grid(acc, SFT_TINY.eval_prompts)
    policy = load_policy(str(out), device="cpu")
    assert policy.eos_token_id == 1
    assert not same_weights(policy.model, load_policy("tiny:1m", device="cpu").model)


def test_sft_is_deterministic(tmp_path: Path) -> None:
    """The same SFT config twice gives bit-identical weights and the same history."""
    a = run_sft(SFT_TINY, tmp_path / "a", log=lambda _: None)
    b = run_sft(SFT_TINY, tmp_path / "b", log=lambda _: None)
    assert same_weights(load_policy(str(tmp_path / "a")).model, load_policy(str(tmp_path / "b")).model)

    def without_times(summary: dict) -> list[dict]:
        return [{k: v for k, v in h.items() if k != "time_s"} for h in summary["history"]]

    assert without_times(a) == without_times(b)


def test_sft_without_blur_reports_final_accuracy(tmp_path: Path) -> None:
    """blur_steps=0 skips the blur phase and still reports the final model's accuracies."""
    cfg = SFTConfig(max_learn_steps=2, blur_steps=0, eval_every=2, eval_prompts=8, batch_size=8)
    summary = run_sft(cfg, tmp_path / "noblur", log=lambda _: None)
    assert [h["phase"] for h in summary["history"]] == ["learn"]
    assert on_grid(summary["accuracy_greedy"], cfg.eval_prompts) and on_grid(
        summary["accuracy_sampled"], cfg.eval_prompts
    )
    assert (tmp_path / "noblur" / "model.safetensors").is_file()


def test_sft_refuses_an_output_it_cannot_write_before_training(tmp_path: Path, capsys) -> None:
    """--out that names a file (or lies under one) is one line at once, not a traceback after the training."""
    (tmp_path / "a_file").write_text("", encoding="utf-8")
    for out, why in (
        (tmp_path / "a_file", "File exists"),
        (tmp_path / "a_file" / "model", "Not a directory"),
    ):
        assert main(["sft", "--out", str(out)]) == 2
        assert (
            capsys.readouterr().err
            == f"asyncrl: error: --out {str(out)!r}: cannot write the model there: {why}\n"
        )


def test_sft_command_line_picks_the_tasks_defaults(tmp_path: Path, monkeypatch, capsys) -> None:
    """``asyncrl sft`` without --task is exactly the config builtin:arith was made with;
    ``--task guess`` takes that task's defaults, and given flags replace them; an unknown task
    is refused naming the argument."""
    import asyncrl.builtin.warm_start as sft

    made = []
    monkeypatch.setattr(sft, "run_sft", lambda cfg, out: made.append(cfg) or {"history": []})
    assert main(["sft", "--out", str(tmp_path)]) == 0
    assert main(["sft", "--task", "guess", "--out", str(tmp_path)]) == 0
    assert main(["sft", "--task", "calculator", "--answer-noise", "0.3", "--out", str(tmp_path)]) == 0
    assert made == [
        SFTConfig(),
        sft_config("guess"),
        sft_config("calculator", answer_noise=0.3),
    ]
    assert (made[1].max_turns, made[1].answer_noise) == (6, 0.5) and made[2].blur_steps == 300
    with pytest.raises(SystemExit) as exit_info:
        main(["sft", "--task", "chess", "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "--task: invalid choice: 'chess'" in capsys.readouterr().err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1])
def test_a_command_without_a_stop_of_its_own_stops_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], sig: signal.Signals
) -> None:
    """``asyncrl sft`` (and report, timeline, config) stop on SIGTERM, SIGHUP and SIGUSR1 as on Ctrl-C:
    one line, exit 128 + the signal, the handlers of before put back."""
    before = signal.getsignal(sig)

    def signalled_while_training(cfg, out, **_):
        os.kill(os.getpid(), sig)
        time.sleep(60)  # the handler ends the sleep at once
        raise AssertionError("the signal did not stop the command")

    monkeypatch.setattr("asyncrl.builtin.warm_start.run_sft", signalled_while_training)
    assert main(["sft", "--task", "arithmetic", "--out", str(tmp_path / "sft")]) == 128 + sig.value
    assert capsys.readouterr().err == f"asyncrl: stopped by {sig.name}\n"
    assert signal.getsignal(sig) is before


def test_ctrl_c_stops_a_command_started_with_sigint_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A batch script's shell starts its background commands with SIGINT ignored; ``asyncrl sft``
    so started ran to its end through a SIGINT sent to it. Now: one line, exit 130, and SIGINT
    ignored again after."""
    stopped = []

    def signalled_while_training(cfg, out, **_):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)  # the handler ends the sleep at once
        stopped.append(False)
        raise AssertionError("SIGINT did not stop the command")

    monkeypatch.setattr("asyncrl.builtin.warm_start.run_sft", signalled_while_training)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["sft", "--task", "arithmetic", "--out", str(tmp_path / "sft")]) == 130
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert capsys.readouterr().err == "asyncrl: stopped by SIGINT\n" and stopped == []


def test_the_exit_freezes_objects_out_of_the_last_collection_unless_a_module_checks_for_leaks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frozen objects are never collected; nanobind's leak check (triton's, loaded where a CUDA
    torch is) would print each one after the run's last line, so with it loaded nothing is frozen."""
    import gc
    import types

    from asyncrl.lifeline import freeze_for_exit

    # Python 3.12 starts with objects in the permanent generation already: count what is added.
    before = gc.get_freeze_count()
    try:
        monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
        assert freeze_for_exit() is False and gc.get_freeze_count() == before
        monkeypatch.delitem(sys.modules, "triton")
        assert freeze_for_exit() is True and gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


@pytest.mark.multiprocess
def test_the_fork_server_alone_freezes_its_objects_out_of_its_last_collection() -> None:
    """The local runtime's fork server imported torch and transformers: collecting them at its exit
    kept it alive after the run's. Its first preload freezes them out, as the program does for
    the run's process; the run's process importing the runtime does not load it. Where a module
    that checks for leaks at exit is loaded (triton, with a CUDA build of torch) nothing is frozen:
    test_the_exit_freezes_objects_out_of_the_last_collection_unless_a_module_checks_for_leaks."""
    from asyncrl.runtimes.processes import PRELOAD

    assert PRELOAD[0] == "asyncrl.runtimes.fork_server"
    probe = (
        "import atexit, gc, sys\n"
        "import asyncrl.runtimes.local\n"
        "from asyncrl.lifeline import LEAK_CHECKED_MODULES\n"
        "print('in the run', 'asyncrl.runtimes.fork_server' in sys.modules)\n"
        "before = gc.get_freeze_count()  # not 0 on Python 3.12\n"
        "atexit.register(lambda: print('frozen at exit', gc.get_freeze_count() > before))  # runs after the server's\n"
        "import asyncrl.runtimes.fork_server\n"
        "print('leak checked', any(name in sys.modules for name in LEAK_CHECKED_MODULES))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert proc.returncode == 0, proc.stderr
    run_line, checked_line, frozen_line = proc.stdout.splitlines()
    leak_checked = checked_line == "leak checked True"
    assert run_line == "in the run False" and checked_line in ("leak checked True", "leak checked False")
    assert frozen_line == f"frozen at exit {not leak_checked}"
