"""Rollout: prompts into scored groups, on an engine (the :class:`~asyncrl.rollout.interface.Rollout` seam)."""
