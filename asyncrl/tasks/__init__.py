"""Tasks: where prompts come from and how completions are rewarded."""

from asyncrl.tasks.arithmetic import ArithmeticTask
from asyncrl.tasks.base import PromptSource, PromptStream
from asyncrl.tasks.hf_dataset import HFDataset, load_rows
from asyncrl.tasks.jsonl import JsonlDataset
from asyncrl.tasks.rewards import RewardSet, RewardTerm, register_reward, resolve_reward, score

__all__ = [
    "ArithmeticTask",
    "HFDataset",
    "JsonlDataset",
    "PromptSource",
    "PromptStream",
    "RewardSet",
    "RewardTerm",
    "load_rows",
    "register_reward",
    "resolve_reward",
    "score",
]
