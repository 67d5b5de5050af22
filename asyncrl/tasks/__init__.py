"""Tasks: where prompts come from and how completions are rewarded."""

from asyncrl.tasks.arithmetic import ArithmeticTask
from asyncrl.tasks.base import PromptSource, PromptStream
from asyncrl.tasks.jsonl import JsonlDataset
from asyncrl.tasks.rewards import register_reward, resolve_reward, score

__all__ = [
    "ArithmeticTask",
    "JsonlDataset",
    "PromptSource",
    "PromptStream",
    "register_reward",
    "resolve_reward",
    "score",
]
