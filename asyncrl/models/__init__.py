"""Models: Hugging Face causal LMs from a local path and the built-in tiny models."""

from asyncrl.models.loading import Policy, load_policy, resolve_device, save_policy

__all__ = ["Policy", "load_policy", "resolve_device", "save_policy"]
