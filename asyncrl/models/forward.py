"""Calling a causal LM with a KV cache across transformers versions.

transformers 5 renamed the forward keyword that takes the cache from ``past_key_values`` to
``cache`` (the old name warns, and goes in 5.40); 4.x models, and remote-code models
written for them, only know ``past_key_values``. The engine and the trainer's prefix-tree
forward pass their cache through :func:`with_cache`, which uses the name the model's own
forward declares.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


@functools.cache
def _cache_keyword(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (whose own forward takes ``**kwargs``)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def with_cache(model: torch.nn.Module, cache: Any, **inputs: Any) -> Any:
    """``model(**inputs)`` with ``cache`` as its KV cache, under the keyword the model declares."""
    keyword = _cache_keyword(type(base_model(model)))
    return model(**inputs, **{keyword: cache})
