"""Rewards: the registry of reward functions, scoring groups with them, time-limited calls,
the reward pool shared by the generators, step rewards and LLM judges."""
