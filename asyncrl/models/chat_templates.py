"""model.chat_template and model.chat_template_kwargs on a loaded tokenizer.

Apart from :mod:`asyncrl.models.loading` so that what renders conversations
(:mod:`asyncrl.prompts.chat`, imported by every reward process) reaches the kwargs' attribute
name without importing torch and transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.errors import ConfigError, looked_in

CHAT_TEMPLATE_KWARGS = (
    "asyncrl_chat_template_kwargs"  # the tokenizer's attribute of model.chat_template_kwargs
)


def load_chat_template(spec: str) -> str:
    """``model.chat_template``: a path to a template file, or the Jinja template itself."""
    if "{" not in spec:
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(
                "model.chat_template",
                spec,
                f"not a file, and not a template (no '{{' in it){looked_in(path)}",
            )
        return path.read_text(encoding="utf-8")
    return spec


def apply_chat_template_override(tokenizer, spec: str | None, kwargs: dict[str, Any] | None = None) -> None:
    """Replace the tokenizer's chat template with ``model.chat_template`` when it is set, and keep
    ``model.chat_template_kwargs`` with the tokenizer for every rendering of it
    (:func:`asyncrl.prompts.chat.render_chat` reads them)."""
    if spec is not None:
        tokenizer.chat_template = load_chat_template(spec)
    # An attribute of our own on the tokenizer: it goes wherever the tokenizer goes in this
    # process, and save_pretrained leaves it out (the saved template stays the template).
    setattr(tokenizer, CHAT_TEMPLATE_KWARGS, dict(kwargs or {}))
