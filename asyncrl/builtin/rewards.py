"""The toy world's own reward function, registered: the chain task's ``chain_match``.

The reward registry is filled by this module alone (not by every plugin), so a process that
only scores, such as a reward pool's worker, resolves a named reward without importing torch,
transformers and the shipped models (seconds per worker).
"""

from __future__ import annotations

from asyncrl.builtin.chains import chain_match
from asyncrl.rewards.registry import REWARDS

REWARDS.register("chain_match", chain_match)
