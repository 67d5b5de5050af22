"""Config sections of what is trained on and how it is scored: the model, the task and its
rewards, multi-turn episodes, and the LLM judge."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.config.device import Device
from asyncrl.config.section import Section


class ModelConfig(Section):
    """The policy to train."""

    path: str = Field(
        "builtin:arith",
        description="A local Hugging Face model directory, a shipped warm-started tiny model ('builtin:arith'; "
        "'builtin:chain' for task.name=chain; 'builtin:calculator' and 'builtin:guess' for those "
        "episode.environment values; 'builtin:tools' for episode.tools' Hermes calls of "
        "asyncrl.builtin.tool_functions:calculate; 'builtin:verify' for the two-role "
        "asyncrl.builtin.verify:verify_episode), or "
        "'tiny:<size>[:<arch>]' for a random tiny model (sizes 1m, 6m; arch qwen2, llama).",
    )
    device: Device = Field(
        "auto", description="'auto' (CUDA when available, else CPU), 'cpu', or 'cuda[:N]'."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype: the generators' engines hold their weights in it, and the trainer runs "
        "its forward and backward passes in it (autocast) while keeping its own weights in "
        "trainer.master_dtype. 'auto' is bfloat16 on CUDA and float32 on the CPU. Log-probs, entropies "
        "and losses are always computed in float32 from the logits.",
    )
    head_dtype: Literal["model", "float32"] = Field(
        "model",
        description="The LM head's logits: 'model' in the compute dtype, as the model computes them; "
        "'float32' from the same operands in float32, in the trainer (the policy and the KL reference), "
        "the embedded engine and vLLM (hf_overrides head_dtype) alike: TRL's cast_lm_head_to_fp32, "
        "ScaleRL's fix of the training-inference log-prob mismatch of a bfloat16 head (docs/engine.md). "
        "Needs a plain Linear output layer.",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template for conversational prompts, replacing the tokenizer's: a path to a Jinja "
        "file, or the template itself (any value containing '{'). null = the tokenizer's own.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template wherever it renders the policy's conversations "
        "(prompts, episodes' turns, asyncrl serve's chat endpoint): TRL's chat_template_kwargs, e.g. "
        "{enable_thinking: false} for a Qwen3 template.",
    )


class ArithmeticConfig(Section):
    """The built-in integer-arithmetic task: prompts like '12+7=' answered by '19'."""

    ops: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1, description="Operators to draw from.")
    min_digits: int = Field(1, ge=1, le=9, description="Fewest digits of each operand.")
    max_digits: int = Field(2, ge=1, le=9, description="Most digits of each operand.")

    @model_validator(mode="after")
    def _digits_ordered(self) -> ArithmeticConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must not exceed max_digits ({self.max_digits})")
        return self


class ChainConfig(Section):
    """The built-in chain task: prompts like '3+14+5+9=' answered by the running results '17,22,31'."""

    terms: int = Field(
        4,
        ge=2,
        le=16,
        description="Numbers in a chain; the answer writes terms - 1 running results, comma separated "
        "(rollout.max_new_tokens must cover them and EOS: 16 for the defaults' 11 characters at most).",
    )
    ops: list[Literal["+", "-"]] = Field(
        ["+"],
        min_length=1,
        description="Operators to draw from; a '-' that would make the running value negative becomes a '+'.",
    )
    min_digits: int = Field(1, ge=1, le=9, description="Fewest digits of each number.")
    max_digits: int = Field(2, ge=1, le=9, description="Most digits of each number.")

    @model_validator(mode="after")
    def _digits_ordered(self) -> ChainConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must not exceed max_digits ({self.max_digits})")
        return self


class RewardEntry(Section):
    """One of several reward functions; the reward is the weighted sum of their values."""

    name: str = Field(
        description="A registered reward (exact_match, chain_match, numeric_match, math_verify, format_regex, "
        "overlong_penalty, judge) or 'module:function'."
    )
    weight: float = Field(1.0, description="Weight of this function in the summed reward.")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments of every call (e.g. {pattern: '...'} for format_regex).",
    )
    label: str | None = Field(
        None, description="Name in metrics (reward/<label>); default: the function's name."
    )


class TaskConfig(Section):
    """Where prompts come from and how completions are scored."""

    name: Literal["arithmetic", "chain", "jsonl", "dataset", "guess", "environment"] = Field(
        "arithmetic",
        description="'arithmetic' (built-in, generated), 'chain' (built-in, generated: running results of "
        "a chain of additions and subtractions, scored by reward chain_match), 'jsonl' (a JSONL file), 'dataset' (Hugging Face "
        "`datasets`: a directory saved with save_to_disk, a folder of data files, or a .parquet, .jsonl, "
        ".json or .csv file; a row's prompt is a string or a list of chat messages), 'guess' (the "
        "built-in guessing game's secrets, played with episode.environment=guess), or 'environment' (no "
        "data: the one environment class of episode.tools returns each prompt from reset, appended to an "
        "empty user message; TRL's environment_factory without a train_dataset).",
    )
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    chain: ChainConfig = Field(default_factory=ChainConfig)
    guess_max: int = Field(16, ge=2, description="task.name=guess: secrets are integers in 1..guess_max.")
    path: str | None = Field(
        None,
        description="The dataset file or directory (task.name=jsonl or dataset; refused with another task.name).",
    )
    split: str = Field("train", description="Split trained on (task.name=dataset).")
    eval_split: str | None = Field(
        None,
        description="Split evaluated on (a dataset directory with several splits). null = see eval_fraction.",
    )
    eval_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Hold out this fraction of the rows (chosen by task.seed) for evaluation, and train on "
        "the rest. 0 with no eval_split = evaluate on the first rows of the training data.",
    )
    prompt_field: str = Field(
        "prompt", description="Column holding the prompt (a string, or a list of {role, content} messages)."
    )
    answer_field: str | None = Field(
        "answer", description="Column holding the reference answer (null = rows have none)."
    )
    reward: str | None = Field(
        "exact_match",
        description="Reward function: a registered name (exact_match, chain_match, numeric_match, math_verify, "
        "format_regex, overlong_penalty, judge: the LLM judge of the judge section) or 'module:function'. Per-completion "
        "(`completion, prompt, answer, **fields`) and TRL's batched signature (`prompts, completions, "
        "**columns` -> list) are both accepted. null: none, with episode.tools whose environment classes "
        "all define get_reward(), which is then the reward (TRL without reward_funcs).",
    )
    rewards: list[RewardEntry] = Field(
        default_factory=list,
        description="Several reward functions [{name, weight, args, label}]: the reward is the weighted sum, "
        "each is logged as reward/<label>. When given, it replaces task.reward.",
    )
    reward_on_error: Literal["zero", "drop_group"] = Field(
        "zero",
        description="When the reward function raises or returns a non-finite or non-numeric value: score the "
        "completion 0, or drop its whole group. The error is recorded per sample either way.",
    )
    skip_bad_rows: bool = Field(
        False,
        description="Skip (and count) malformed dataset rows instead of failing; the run warns how many, "
        "naming the first.",
    )
    reward_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Time limit per reward call. When set, the reward function runs in its own processes "
        "(see reward_processes); one whose call runs late is killed and replaced, and the call counts as a "
        "reward error (see reward_on_error). null = call it directly, in order, no limit.",
    )
    reward_processes: int = Field(
        8,
        ge=1,
        description="With reward_timeout_s: the most reward processes per reward function and worker. The "
        "calls of the groups being scored together run concurrently, each with its own time limit, so "
        "a batch costs about one timeout per `reward_processes` calls that hang, not one per call.",
    )
    reward_workers: int = Field(
        0,
        ge=0,
        description="Reward workers separate from the generators, shared by all of them: N processes (Ray: N "
        "actors, runtime.ray.reward) that hold the reward functions. A generator hands finished groups "
        "over (up to N batches at once) and goes on decoding while the least busy worker scores them "
        "(with reward_timeout_s the calls run time-limited in the worker's reward processes). 0 = score "
        "in the generator's own thread, between engine steps.",
    )
    reward_max_consecutive_failures: int = Field(
        64,
        ge=0,
        description="Stop the run, naming the function and its last error, when one reward function fails "
        "(raises, returns a non-finite or non-numeric value, or times out) on this many calls in a row "
        "(a per-completion function: one call per completion; a batched one: one per group). "
        "0 = never stop for reward errors.",
    )
    step_delimiter: str | None = Field(
        None,
        min_length=1,
        description="Process rewards of single completions: cut each completion into steps after every token "
        "whose text contains this string (e.g. a newline); reward functions also get the steps' texts "
        "(completion_steps) and may return asyncrl.rewards.step_rewards.StepRewards, one reward per step, "
        "trained with algorithm.step_rewards=return_to_go. null = no steps.",
    )
    seed: int = Field(
        0,
        description="Seed of the prompt stream (arithmetic and chain generation, dataset shuffling and "
        "held-out rows).",
    )

    @model_validator(mode="after")
    def _path_for_datasets(self) -> TaskConfig:
        if self.name in ("jsonl", "dataset") and not self.path:
            raise ValueError(f"task.name={self.name} needs task.path")
        if self.path and self.name not in ("jsonl", "dataset"):
            # A file given to a generated task would be ignored: the run would train on the
            # built-in prompts while its user believes it trains on the file.
            raise ValueError(
                f"task.path={self.path!r} is read only by task.name=jsonl (a JSONL file) or dataset "
                f"(a Hugging Face dataset directory or file), and task.name is {self.name!r}: set task.name"
            )
        if self.eval_split is not None and self.eval_fraction > 0:
            raise ValueError("give task.eval_split or task.eval_fraction, not both")
        labels = [e.label or e.name.rpartition(":")[2] for e in self.rewards]
        if len(set(labels)) != len(labels):
            raise ValueError(
                f"task.rewards: two entries share a label ({labels}); set 'label' to tell them apart"
            )
        return self


class EpisodeConfig(Section):
    """Multi-turn episodes (asyncrl.episodes): the model acts in an environment over several turns."""

    environment: str | None = Field(
        None,
        description="null = single-turn completions. A built-in ('calculator' on the arithmetic task, 'guess' "
        "on task.name=guess, 'verify': a solver and a verifier on the arithmetic task, see multi_agent) or "
        "'module:name' of an environment class (built as cls(task, seed), with reset and step) or of an "
        "`async def episode(client, task)` function (`async def episode(team, task)` with multi_agent.roles). "
        "The episode's reward replaces task.reward.",
    )
    tools: list[str] = Field(
        default_factory=list,
        description="Tool calling (TRL's `tools`): 'module:function' of Python functions (sync or async, "
        "with type hints and a docstring documenting each argument) the model calls in its turns, in "
        'the Hermes format (<tool_call>{"name": ..., "arguments": {...}}</tool_call>, as Qwen2.5 '
        "and Qwen3 templates write), and 'module:Class' environments (TRL's `environment_factory`): one "
        "instance per episode, reset(**row) first (text it returns ends the prompt), its public methods "
        "tools, an optional get_reward() added to the reward; with several classes each row names its "
        "own in an 'environment' column. The schemas go to the chat template; each call's result is appended as a "
        "tool message, and the task's reward functions score the episode. Needs a conversational task "
        "and a template that renders tool calls; not with environment.",
    )
    tool_parser: str = Field(
        "hermes",
        description="How tool calls are read from a turn (episode.tools): 'hermes' (<tool_call>{json}"
        "</tool_call> blocks), 'response_template' (the tokenizer's own response template, read by "
        "transformers' parse_response: Qwen3.5's XML parameters, Llama's or GPT-OSS's formats), or a "
        "JSON file holding a response template.",
    )
    max_turns: int = Field(
        4,
        ge=1,
        description="Most model turns per episode; more truncates it. With tools: TRL's "
        "max_tool_calling_iterations + 1 (a last turn's calls are not run).",
    )
    step_timeout_s: float | None = Field(
        60.0,
        gt=0,
        description="Time limit of one environment call (reset or step). One that runs late ends its episode "
        "with an error, handled like a reward error (task.reward_on_error). null = no limit. An async "
        "episode function bounds its own tool calls.",
    )
    tool_threads: int = Field(
        64,
        ge=1,
        description="Threads a generator gives blocking environment calls (tools), shared by its episodes.",
    )
    max_episode_tokens: int = Field(
        64,
        ge=1,
        description="Most tokens after the prompt (turns and observations); a turn gets at most "
        "min(rollout.max_new_tokens, what is left). An episode that runs out is truncated.",
    )

    @property
    def enabled(self) -> bool:
        """Whether the run plays multi-turn episodes (an environment or tool calling)."""
        return self.environment is not None or bool(self.tools)


JUDGE_FIELDS = ("prompt", "completion", "answer")


class JudgeConfig(Section):
    """A frozen LLM judge for model-based rewards (asyncrl.rewards.judges; the registered reward 'judge')."""

    model: str | None = Field(
        None,
        description="The judge model (a local Hugging Face directory, 'builtin:arith' or 'tiny:<size>'). The "
        "run serves it with its own engine in a process of its own (`asyncrl serve`, on a free port of "
        "127.0.0.1) for the run's lifetime. null = no judge, or see url.",
    )
    url: str | None = Field(
        None,
        description="Instead of model: the base URL of a judge already served with `asyncrl serve` "
        "(e.g. http://127.0.0.1:8000; with Ray on several machines, one every worker can reach).",
    )
    mode: Literal["verdict", "parse"] = Field(
        "verdict",
        description="'verdict': the reward is P(yes) / (P(yes) + P(no)) of the judge's next token after the "
        "rendered template (one forward pass, no sampling). 'parse': the judge answers greedily (up to "
        "max_new_tokens) and the first match of `pattern` is the score, mapped from [score_min, score_max] "
        "to [0, 1].",
    )
    template: str = Field(
        "Question: {prompt}\nAnswer: {completion}\nIs the answer correct? Answer Yes or No.\nVerdict:",
        description="The judge's prompt; {prompt}, {completion} and {answer} (the reference answer, '' if "
        "none) are filled in. Must contain {completion}.",
    )
    chat: bool = Field(
        False, description="Send the rendered template as a user message through the judge's chat template."
    )
    yes: str = Field(" Yes", description="mode=verdict: the verdict token that means correct (one token).")
    no: str = Field(" No", description="mode=verdict: the verdict token that means wrong (one token).")
    pattern: str = Field(
        r"-?\d+(?:\.\d+)?", description="mode=parse: regular expression whose first match is the score."
    )
    score_min: float = Field(0.0, description="mode=parse: the score that maps to reward 0.")
    score_max: float = Field(10.0, description="mode=parse: the score that maps to reward 1 (clipped).")
    max_new_tokens: int = Field(16, ge=1, description="mode=parse: most tokens of the judge's answer.")
    timeout_s: float = Field(
        120.0, gt=0, description="Time limit of one request to the judge (a batch of completions)."
    )
    device: Device = Field(
        "auto", description="Where the judge model runs ('auto', 'cpu', 'cuda', 'cuda:1')."
    )
    max_batch_size: int = Field(64, ge=1, description="The judge engine's running batch.")

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        import re
        import string

        if self.model is not None and self.url is not None:
            raise ValueError(
                "judge.model and judge.url are alternatives: serve the model, or use a served one"
            )
        names = {f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None}
        unknown = sorted(names - set(JUDGE_FIELDS))
        if unknown or "completion" not in names:
            raise ValueError(
                f"judge.template may use {{prompt}}, {{completion}} and {{answer}}, and must use {{completion}}; "
                f"it has {sorted(names)}"
            )
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"judge.pattern {self.pattern!r} is not a regular expression: {exc}") from None
        if self.score_max <= self.score_min:
            raise ValueError(
                f"judge.score_max ({self.score_max}) must be above judge.score_min ({self.score_min})"
            )
        return self
