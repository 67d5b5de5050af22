"""``asyncrl eval``: a run's saved model evaluated as the run evaluates it, best of k, completions
written as they are scored, stops that keep them, and bad input named."""

from __future__ import annotations

import contextlib
import io
import json
import math
import signal
import textwrap
from itertools import combinations
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.rollout.evaluation import best_of_k, best_of_ks, outcome_figures
from asyncrl.types import Prompt
from tests.helpers import sets

SHORT_RUN = [
    "run.steps=3",
    "rollout.prompts_per_step=4",
    "run.eval_every=3",
    "run.eval_prompts=60",
    "run.progress=false",
    "runtime.trainer_threads=1",
]


def run_cli(*args: str) -> tuple[int, dict | None]:
    """``asyncrl ARGS`` in this process: (exit code, the JSON line it printed, if any)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    lines = out.getvalue().strip().splitlines()
    return code, json.loads(lines[-1]) if lines else None


def trained(run_dir: Path, *extra: str) -> list[dict]:
    """A 3-step run of the default example into ``run_dir`` (evaluated at steps 0 and 3): its evaluations."""
    code, _ = run_cli("train", *sets([*SHORT_RUN, *extra]), "--run-dir", str(run_dir))
    assert code == 0
    return read_jsonl(run_dir / "eval.jsonl")


def test_best_of_k_is_the_mean_best_of_every_k_subset() -> None:
    """best_of_k against every k-subset enumerated, on 0/1 rewards (pass@k: 1 - C(n-c,k)/C(n,k)) and graded ones."""
    for rewards in ([1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0, 0.0], [0.2, 0.5, 1.0, 0.5], [0.0] * 3):
        n = len(rewards)
        for k in range(1, n + 1):
            subsets = list(combinations(rewards, k))
            assert best_of_k(rewards, k) == pytest.approx(sum(max(s) for s in subsets) / len(subsets))
        c = sum(r == 1.0 for r in rewards)
        if all(r in (0.0, 1.0) for r in rewards):
            assert best_of_k(rewards, 2) == pytest.approx(1 - math.comb(n - c, 2) / math.comb(n, 2))
    assert best_of_k([0.2, 0.5, 1.0], 2) == pytest.approx(2.5 / 3)
    with pytest.raises(ValueError, match="k=3"):
        best_of_k([1.0, 0.0], 3)
    assert [best_of_ks(n) for n in (1, 2, 3, 4, 6, 8)] == [
        [1],
        [1, 2],
        [1, 2, 3],
        [1, 2, 4],
        [1, 2, 4, 6],
        [1, 2, 4, 8],
    ]
    # Three prompts, one without outcomes (dropped): it counts 0 in every figure.
    prompts = [Prompt(name, "x") for name in "abc"]
    scored = [(prompts[0], [1.0, 0.0, 0.0, 0.0]), (prompts[1], [0.0, 1.0, 1.0, 0.0])]
    assert outcome_figures(scored, prompts, n=4) == {
        "eval_accuracy": pytest.approx(3 / 12),
        "eval_best_of_2": pytest.approx((0.5 + 5 / 6) / 3),
        "eval_best_of_n": pytest.approx(2 / 3),
    }


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    return run_dir, trained(run_dir)


def test_a_runs_final_model_scores_the_runs_last_evaluation(full_run, tmp_path: Path) -> None:
    """``asyncrl eval --run RUN_DIR`` evaluates final/ with the run's config: the figure the run
    logged at its last step, exactly, and one completion record per prompt whose rewards average to it."""
    run_dir, evals = full_run
    completions = tmp_path / "completions.jsonl"
    code, report = run_cli("eval", "--run", str(run_dir), "--completions", str(completions))
    assert code == 0
    assert report["model"] == str(run_dir / "final")
    assert report["eval_accuracy"] == evals[-1]["eval_accuracy"]
    assert report["prompts"] == report["prompts_done"] == 60 and report["samples_per_prompt"] == 1
    assert "eval_best_of_n" not in report and "stopped" not in report
    records = read_jsonl(completions)
    assert len(records) == 60 and len({r["prompt_id"] for r in records}) == 60
    assert sum(r["reward"] or 0.0 for r in records) / 60 == pytest.approx(report["eval_accuracy"])
    assert sum(report["finish_reasons"].values()) == 60
    assert report["completion_tokens"] == sum(r["completion_tokens"] for r in records)
    first = records[0]
    assert (
        first["prompt"].endswith("=")
        and first["answer"] is not None
        and first["rewards"].keys() == {"exact_match"}
    )


def test_sampled_evaluations_give_best_of_k_for_powers_of_two(full_run, tmp_path: Path) -> None:
    """--samples 4 --temperature 1: mean@4, best of 2 (the mean over prompts of best_of_k of the
    written rewards) and best of 4, in order; the same figures again."""
    run_dir, _ = full_run
    completions = tmp_path / "sampled.jsonl"
    args = ["eval", "--run", str(run_dir), "--samples", "4", "--temperature", "1", "--prompts", "20"]
    code, report = run_cli(*args, "--completions", str(completions))
    assert code == 0 and report["samples_per_prompt"] == 4 and report["prompts"] == 20
    assert report["eval_accuracy"] <= report["eval_best_of_2"] <= report["eval_best_of_n"]
    by_prompt: dict[str, list[float]] = {}
    for r in read_jsonl(completions):
        by_prompt.setdefault(r["prompt_id"], []).append(r["reward"] or 0.0)
    assert len(by_prompt) == 20 and all(len(v) == 4 for v in by_prompt.values())
    assert report["eval_best_of_2"] == pytest.approx(sum(best_of_k(v, 2) for v in by_prompt.values()) / 20)
    assert report["eval_best_of_n"] == pytest.approx(sum(max(v) for v in by_prompt.values()) / 20)
    assert report["eval_accuracy"] == pytest.approx(sum(map(sum, by_prompt.values())) / 80)
    again = run_cli(*args)[1]
    assert {k: v for k, v in again.items() if k not in ("seconds", "tokens_per_s")} == {
        k: v for k, v in report.items() if k not in ("seconds", "tokens_per_s")
    }


@pytest.mark.slow  # the same command on a full run: test_a_runs_final_model_scores_the_runs_last_evaluation
def test_a_lora_runs_adapters_are_merged_into_its_base(tmp_path: Path) -> None:
    """A LoRA run's final/ is adapters: eval --run merges them into the run's base and scores the
    run's last evaluation; a checkpoint's adapters (--model with --run) score the same at that step;
    the adapters alone, without the run's config, are refused by name."""
    run_dir = tmp_path / "lora"
    evals = trained(run_dir, "lora.rank=8", "trainer.lr=1e-3", "run.checkpoint_every=3")
    code, report = run_cli("eval", "--run", str(run_dir))
    assert code == 0 and report["eval_accuracy"] == evals[-1]["eval_accuracy"]
    assert evals[-1]["eval_accuracy"] != evals[0]["eval_accuracy"]  # the adapters changed what it answers
    checkpoint = run_dir / "checkpoints" / "step-000003" / "model"
    code, at_checkpoint = run_cli("eval", "--run", str(run_dir), "--model", str(checkpoint))
    assert code == 0 and at_checkpoint["eval_accuracy"] == report["eval_accuracy"]
    assert at_checkpoint["model"] == str(checkpoint)
    assert run_cli("eval", "--model", str(run_dir / "final"))[0] == 2


def signalling_reward(tmp_path: Path, module: str, *signals: signal.Signals) -> str:
    """A reward module (``module:score``) that sends this process ``signals`` on its 5th call."""
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            f"""
            import os
            calls = []

            def score(completion, answer=None, **_):
                calls.append(1)
                if len(calls) == 5:
                    for sig in {[int(s) for s in signals]}:
                        os.kill(os.getpid(), sig)
                return float(completion.strip() == answer)
            """
        ),
        encoding="utf-8",
    )
    return f"{module}:score"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_reports_the_prompts_it_finished_and_keeps_their_completions(
    sig: signal.Signals, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stop during scoring, delivered twice (to the process and to its group): the groups scored
    so far (at least the 5 scored before it) are the report's, marked stopped, every one of them
    in the completions file; one line on stderr, exit 128 + the signal, the handlers of before put back."""
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = signalling_reward(tmp_path, f"asyncrl_test_eval_stop_{sig.name.lower()}", sig, sig)
    before = signal.getsignal(sig)
    completions = tmp_path / "completions.jsonl"
    code, report = run_cli(
        "eval", "--set", f"task.reward={reward}", "--prompts", "200", "--completions", str(completions)
    )
    assert code == 128 + sig.value
    assert report["stopped"] is True and 5 <= report["prompts_done"] < report["prompts"] == 200
    records = read_jsonl(completions)
    assert len(records) == report["prompts_done"]
    assert report["eval_accuracy"] == pytest.approx(sum(r["reward"] or 0.0 for r in records) / len(records))
    err = capsys.readouterr().err
    assert err == (
        f"asyncrl: evaluation stopped by {sig.name} after {report['prompts_done']} of 200 prompts "
        "(the figures are theirs)\n"
    )
    assert signal.getsignal(sig) is before


def test_a_second_stop_stops_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """SIGTERM, then Ctrl-C's SIGINT, inside one reward call: the command ends in that call, with the
    second's line and exit code;
    the completions file keeps, as whole lines, the groups written before it (those returned by
    the engine's earlier steps: fewer than the 5 scored)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = signalling_reward(tmp_path, "asyncrl_test_eval_second_stop", signal.SIGTERM, signal.SIGINT)
    completions = tmp_path / "completions.jsonl"
    code, report = run_cli("eval", "--set", f"task.reward={reward}", "--completions", str(completions))
    assert code == 130 and report is None
    assert capsys.readouterr().err == "asyncrl: stopped by SIGINT\n"
    assert 1 <= len(read_jsonl(completions)) < 5


def test_bad_input_is_one_line_naming_it(
    full_run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = full_run
    empty = tmp_path / "empty-run"
    empty.mkdir()
    (empty / "config.yaml").write_text("run:\n  steps: 2\n", encoding="utf-8")
    cases = [
        (
            ["--run", str(run_dir), "examples/grpo_kl.yaml"],
            "--run RUN_DIR evaluates with that run's own config.yaml",
        ),
        (["--run", str(tmp_path)], f"--run {str(tmp_path)!r}: not a run directory (no config.yaml)"),
        (["--run", str(empty)], "the run saved no model yet (no final/ and no checkpoint)"),
        (["--samples", "0"], "--samples must be >= 1, got 0"),
        (
            ["--samples", "4"],
            "run.eval_temperature=0: greedy completions of one prompt are all the same; set run.eval_temperature > 0 (e.g. 1.0) or run.eval_samples=1 (--samples sets run.eval_samples)",
        ),
        (
            ["--temperature", "-1"],
            "run.eval_temperature=-1.0: Input should be greater than or equal to 0 (--temperature sets run.eval_temperature)",
        ),
        (["--model", str(tmp_path)], "--model=" + repr(str(tmp_path)) + ": the directory has no config.json"),
        (["examples/verify.yaml"], "multi_agent.policies=['verifier']: asyncrl eval evaluates one policy"),
        (
            ["--completions", str(tmp_path)],
            f"--completions {str(tmp_path)!r}: cannot write it: Is a directory",
        ),
    ]
    for args, message in cases:
        capsys.readouterr()
        code, report = run_cli("eval", *args)
        err = capsys.readouterr().err
        assert code == 2 and report is None, args
        assert err.startswith("asyncrl: error: ") and message in err and err.count("\n") == 1, (args, err)


@pytest.mark.vllm
def test_vllm_evaluates_a_run_as_the_embedded_engine_does(full_run, tmp_path: Path) -> None:
    """--set rollout.engine=vllm: the run's final model loaded into vLLM answers the held-out prompts
    greedily as the embedded engine does (float32; at least 57 of 60 completions the same)."""
    run_dir, _ = full_run
    reports, completions = {}, {}
    for engine in ("embedded", "vllm"):
        out = tmp_path / f"{engine}.jsonl"
        code, reports[engine] = run_cli(
            "eval", "--run", str(run_dir), "--set", f"rollout.engine={engine}", "--completions", str(out)
        )
        assert code == 0 and reports[engine]["prompts_done"] == 60
        completions[engine] = {r["prompt_id"]: r["completion"] for r in read_jsonl(out)}
    assert completions["vllm"].keys() == completions["embedded"].keys()
    same = sum(completions["vllm"][p] == c for p, c in completions["embedded"].items())
    assert same >= 57, same
    assert abs(reports["vllm"]["eval_accuracy"] - reports["embedded"]["eval_accuracy"]) <= 3 / 60
