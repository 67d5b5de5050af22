"""The ``asyncrl`` command line: train, eval, sft, config, timeline, report, scale, serve."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from asyncrl.cli_args import count, device, fraction, port, seconds
from asyncrl.errors import AsyncRLError, ConfigError
from asyncrl.lifeline import STOP_SIGNALS, freeze_for_exit, note_run_stop, repeats_run_stop, stopped_by


def _quiet_transformers() -> None:
    """No download progress bars from transformers: called by the commands that load a model,
    only once their arguments are checked (importing transformers takes about a second)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _train(args: argparse.Namespace) -> int:
    from asyncrl.config import load_config
    from asyncrl.config.engines import check_engines_installed
    from asyncrl.models.directories import check_model_directory, is_directory_source

    if args.resume:
        if args.config or args.run_dir or args.resume_if_exists:
            raise AsyncRLError(
                "--resume RUN_DIR continues that run with its own config.yaml; "
                "give no CONFIG, --run-dir or --resume-if-exists with it (--set still applies)"
            )
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").is_file():
            raise AsyncRLError(f"--resume {str(run_dir)!r}: not a run directory (no config.yaml)")
        cfg = load_config(str(run_dir / "config.yaml"), args.set)
    else:
        if args.resume_if_exists and not args.run_dir:
            raise AsyncRLError("--resume-if-exists needs --run-dir: the directory whose run it continues")
        run_dir = Path(args.run_dir) if args.run_dir else None
        cfg = load_config(args.config, args.set)
    # A bad config or model directory is refused before the seconds torch and transformers take.
    if is_directory_source(cfg.model.path):
        check_model_directory(Path(cfg.model.path), cfg.model.path)
    check_engines_installed(cfg)
    _quiet_transformers()
    from asyncrl.control.run import RunComplete, train
    from asyncrl.control.saving import RunInterrupted

    try:
        summary = train(
            cfg, run_dir, resume=True if args.resume else "if_exists" if args.resume_if_exists else False
        )
    except RunComplete as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 0
    except RunInterrupted as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps({k: v for k, v in summary.items() if k != "eval"}))
    return 0


def _eval(args: argparse.Namespace) -> int:
    import signal
    import threading

    if args.run and args.config:
        raise AsyncRLError("--run RUN_DIR evaluates with that run's own config.yaml; give no CONFIG with it")
    if args.run and not (Path(args.run) / "config.yaml").is_file():
        raise AsyncRLError(f"--run {args.run!r}: not a run directory (no config.yaml)")
    _quiet_transformers()
    from asyncrl.workers.model_evaluation import (
        evaluate_saved_model,
        evaluation_flags,
        evaluation_setup,
        with_flag_names,
    )

    flags = evaluation_flags(samples=args.samples, temperature=args.temperature, prompts=args.prompts)
    try:
        cfg, target = evaluation_setup(
            str(Path(args.run) / "config.yaml") if args.run else args.config,
            [*args.set, *flags],
            run_dir=Path(args.run) if args.run else None,
            model=args.model,
        )
    except AsyncRLError as exc:
        raise with_flag_names(exc, flags) from None
    stopped: list[int] = []

    def stop_evaluation(signum: int, frame) -> None:
        if not stopped:
            stopped.append(signum)
            note_run_stop(signum)
        elif not repeats_run_stop(signum):  # another stop, not the first delivered twice: at once
            raise _Stopped(signum)

    if threading.current_thread() is threading.main_thread():
        note_run_stop(None)
        for sig in STOP_SIGNALS:
            signal.signal(sig, stop_evaluation)
    report = evaluate_saved_model(cfg, target, stop=lambda: bool(stopped), completions=args.completions)
    print(json.dumps({"model": target.shown, **report}), flush=True)
    if not stopped:
        return 0
    print(
        f"asyncrl: evaluation stopped by {signal.Signals(stopped[0]).name} after {report['prompts_done']} "
        f"of {report['prompts']} prompts (the figures are theirs)",
        file=sys.stderr,
    )
    return 128 + stopped[0]


def _sft(args: argparse.Namespace) -> int:
    from asyncrl.builtin.sft_settings import sft_config

    given = {"blur_steps": args.blur_steps, "answer_noise": args.answer_noise}
    cfg = sft_config(
        args.task,
        model=args.model,
        seed=args.seed,
        **{k: v for k, v in given.items() if v is not None},  # else the task's default
    )
    out = Path(args.out)
    try:  # before the minutes of training, not after them
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AsyncRLError(
            f"--out {args.out!r}: cannot write the model there: {exc.strerror or exc}"
        ) from None
    _quiet_transformers()
    from asyncrl.builtin.warm_start import run_sft

    summary = run_sft(cfg, out)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}))
    return 0


def _config(args: argparse.Namespace) -> int:
    from asyncrl.config import dump_config, load_config
    from asyncrl.config.reference import config_reference

    if args.docs:
        print(config_reference(), end="")
    else:
        print(dump_config(load_config(args.config, args.set)), end="")
    return 0


def _timeline(args: argparse.Namespace) -> int:
    from asyncrl.reports.timeline import plot_timeline

    busy = plot_timeline(Path(args.run_dir), Path(args.output), title=args.title, last_s=args.last)
    print(json.dumps({"output": args.output, "busy_frac": {k: round(v, 4) for k, v in busy.items()}}))
    return 0


def _report(args: argparse.Namespace) -> int:
    from asyncrl.reports.html import write_report

    print(json.dumps(write_report([Path(p) for p in args.run_dirs], Path(args.output))))
    return 0


def _scale(args: argparse.Namespace) -> int:
    from asyncrl.control.scaling import write_control

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise AsyncRLError(f"{str(run_dir)!r} is not a run directory (no config.yaml)")
    if args.generators < 1:
        raise AsyncRLError(f"--generators must be >= 1, got {args.generators}")
    write_control(run_dir, args.generators)
    print(json.dumps({"run_dir": str(run_dir), "generators": args.generators}))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from asyncrl.models.directories import check_model_directory, is_directory_source

    if args.set and args.engine != "vllm":
        raise ConfigError("--set", args.set, "asyncrl serve takes settings only with --engine vllm")
    if is_directory_source(args.model):  # a wrong directory is refused before the heavy imports
        check_model_directory(Path(args.model), args.model)
    _quiet_transformers()
    from asyncrl.models.loading import load_policy
    from asyncrl.server.app import OpenAIServer
    from asyncrl.server.until_stopped import serve_until_stopped
    from asyncrl.workers.vllm_serving import vllm_serving

    if args.exit_with_parent:  # a run's judge: it ends with the run, however the run ends
        from asyncrl.lifeline import exit_with_parent, ignore_stop_signals

        exit_with_parent(os.getppid())
        ignore_stop_signals()  # the run stops it by closing its stdin; a signal to the group is the run's
    policy = load_policy(args.model, device=args.device, seed=args.seed)
    serving = None
    if args.engine == "vllm":
        serving = vllm_serving(
            policy, model=args.model, max_batch_size=args.max_batch_size, seed=args.seed, overrides=args.set
        )
    server = OpenAIServer(
        policy,
        model_name=args.name or args.model,
        max_batch_size=args.max_batch_size,
        seed=args.seed,
        serving=serving,
    )
    host, port = server.start(args.host, args.port)
    print(json.dumps({"listening": f"http://{host}:{port}", "model": server.model_name}), flush=True)
    serve_until_stopped(server, args.drain_timeout_s, owned=args.exit_with_parent)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from asyncrl.builtin.sft_settings import TASK_DEFAULTS, TASKS, SFTConfig

    parser = argparse.ArgumentParser(
        prog="asyncrl", description="Asynchronous RL post-training of language models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run RL training (default: the built-in arithmetic example on CPU)")
    train.add_argument("config", nargs="?", help="YAML config file (optional)")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. trainer.lr=1e-4",
    )
    train.add_argument(
        "--run-dir", help="where to write config, metrics and the final model (default runs/<time>)"
    )
    train.add_argument(
        "--resume", metavar="RUN_DIR", help="continue a stopped run from its newest checkpoint"
    )
    train.add_argument(
        "--resume-if-exists",
        action="store_true",
        help="continue the run --run-dir holds (with these settings) if it holds one, else start it "
        "there: the same command for a job's first start and its restarts (Slurm requeue, a pod restarted)",
    )
    train.set_defaults(func=_train)

    evaluate = sub.add_parser(
        "eval",
        help="evaluate a model (a run's final model or newest checkpoint, a model directory) on the task's "
        "held-out prompts: the run's evaluation, with best of k (pass@k)",
    )
    evaluate.add_argument("config", nargs="?", help="YAML config file of the task and sampling (optional)")
    evaluate.add_argument(
        "--run",
        metavar="RUN_DIR",
        help="evaluate this run's model (final/, else its newest checkpoint) with its config.yaml",
    )
    evaluate.add_argument(
        "--model",
        help="the model to evaluate: a model directory (a checkpoint's model/; with --run, LoRA adapters of "
        "that run) or a source as model.path (default: --run's model, else model.path)",
    )
    evaluate.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    evaluate.add_argument("--samples", type=int, help="completions per prompt (run.eval_samples)")
    evaluate.add_argument(
        "--temperature", type=float, help="sampling temperature, 0 = greedy (run.eval_temperature)"
    )
    evaluate.add_argument("--prompts", type=int, help="held-out prompts to evaluate (run.eval_prompts)")
    evaluate.add_argument(
        "--completions", metavar="FILE", help="write every completion, its reward and prompt, as JSON lines"
    )
    evaluate.set_defaults(func=_eval)

    sft = sub.add_parser(
        "sft",
        help="supervised warm start of a tiny model on a built-in task (single-turn or scripted episodes)",
    )
    sft.add_argument("--out", required=True, help="directory for the resulting model")
    sft.add_argument(
        "--task",
        choices=TASKS,
        default="arithmetic",
        help="arithmetic (answers; builtin:arith), chain (running results of a chain of additions; "
        "builtin:chain), calculator or guess (scripted episodes of that environment; builtin:calculator, "
        "builtin:guess), tools (the calculator's episodes with calculate as a tool, episode.tools' Hermes calls; "
        "builtin:tools), verify (scripted episodes of the two-role verify task, both roles; builtin:verify)",
    )
    sft.add_argument("--model", default="tiny:1m", help="model to start from (default tiny:1m)")
    sft.add_argument(
        "--blur-steps",
        type=count(0),
        help="steps on the noisy teacher (default: the task's, "
        + ", ".join(f"{t} {TASK_DEFAULTS[t].get('blur_steps', SFTConfig.blur_steps)}" for t in TASKS)
        + ")",
    )
    sft.add_argument(
        "--answer-noise",
        type=fraction,
        help="share of the noisy teacher's answers (arithmetic, chain, verify: and of its verdicts) or "
        "episodes (calculator, tools) or turns (guess) that go wrong (default: the task's, "
        + ", ".join(f"{t} {TASK_DEFAULTS[t].get('answer_noise', SFTConfig.answer_noise)}" for t in TASKS)
        + ")",
    )
    sft.add_argument("--seed", type=int, default=0)
    sft.set_defaults(func=_sft)

    timeline = sub.add_parser("timeline", help="draw a run's timeline.jsonl as a Gantt chart (PNG)")
    timeline.add_argument("run_dir", help="a run directory")
    timeline.add_argument("-o", "--output", default="timeline.png", help="PNG file to write")
    timeline.add_argument("--last", type=float, help="only the last N seconds of the run")
    timeline.add_argument("--title", help="chart title (default: the run directory name)")
    timeline.set_defaults(func=_timeline)

    report = sub.add_parser(
        "report", help="draw runs' curves and timelines as PNGs and one self-contained HTML page"
    )
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (several: overlaid)")
    report.add_argument(
        "-o", "--output", default="report.html", help="HTML file; PNGs go to <name>-figures/ beside it"
    )
    report.set_defaults(func=_report)

    scale = sub.add_parser(
        "scale", help="change the number of generators of a running run (runtime.kind=ray)"
    )
    scale.add_argument("run_dir", help="the run directory of a run in progress")
    scale.add_argument("--generators", type=int, required=True, help="the new number of generators")
    scale.set_defaults(func=_scale)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    serve.add_argument("--model", default="builtin:arith", help="model source, as model.path in a config")
    serve.add_argument("--name", help="model name reported by the API (default: the source)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port, default=8000, help="0 picks a free port (printed on start)")
    serve.add_argument(
        "--device", type=device, default="auto", help="'auto', 'cpu', 'cuda' or 'cuda:<index>'"
    )
    serve.add_argument("--max-batch-size", type=count(1), default=64, help="most sequences decoded at once")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--engine",
        choices=("embedded", "vllm"),
        default="embedded",
        help="the engine that serves (default embedded)",
    )
    serve.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="with --engine vllm: vllm.* settings"
    )
    serve.add_argument(
        "--drain-timeout-s",
        type=seconds,
        default=20.0,
        help="on a stop, how long the requests in flight get to finish before they are ended with "
        "HTTP 503 (default 20: inside the 30 s a scheduler gives before SIGKILL); a second stop "
        "signal ends them at once",
    )
    serve.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=_serve)

    config = sub.add_parser("config", help="print the resolved config, or the reference of every option")
    config.add_argument("config", nargs="?")
    config.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    config.add_argument("--docs", action="store_true", help="print the Markdown reference of all options")
    config.set_defaults(func=_config)
    return parser


class _Stopped(BaseException):
    """A stop signal other than Ctrl-C's to a command that has no stop of its own (``train`` and
    ``serve`` do)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame) -> None:
    if stopped_by(signum):  # a run's own stop delivered again as it ends: the run reports the stop
        return
    raise _Stopped(signum)


def main(argv: list[str] | None = None) -> int:
    """Run one command; a bad input is one line and exit 2, a stop one line and 128 + the signal."""
    import signal
    import threading

    args = build_parser().parse_args(argv)
    note_run_stop(None)  # this command's runs' stops only
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # As Ctrl-C does for every command; train and serve put their own handlers over these.
        stops = [sig for sig in STOP_SIGNALS if sig != signal.SIGINT]
        previous = {sig: signal.signal(sig, _raise_stopped) for sig in stops}
        # Ctrl-C's own, also where it came ignored: a shell without job control (a batch script)
        # starts its background commands with SIGINT ignored, and a scheduler's SIGINT must stop them.
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return args.func(args)
    except AsyncRLError as exc:
        print(f"asyncrl: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("asyncrl: stopped by SIGINT", file=sys.stderr)  # as the other stop signals say
        return 130
    except _Stopped as stop:
        print(f"asyncrl: stopped by {signal.Signals(stop.signum).name}", file=sys.stderr)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        note_run_stop(None)


def run() -> None:
    """The ``asyncrl`` program: :func:`main`, then an exit that skips the last garbage collection.

    User code a config names as ``module:name`` (a reward, an episode function) is imported as
    ``python -m`` would: from the working directory first, which a console script leaves off
    ``sys.path``.

    At exit the interpreter collects every object torch and transformers created at import;
    they are frozen out of that collection (:func:`asyncrl.lifeline.freeze_for_exit`).
    """
    try:
        here = os.getcwd()
    except OSError:  # a working directory that was removed: nothing to import from it
        here = None
    if here is not None and "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)
    code = main()
    freeze_for_exit()
    sys.exit(code)


if __name__ == "__main__":
    run()
