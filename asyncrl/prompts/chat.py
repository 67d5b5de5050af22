"""Conversational prompts: message lists rendered by the tokenizer's chat template.

A dataset row's ``prompt`` may be a string (used as it is) or a list of messages
``[{"role": "system" | "user" | "assistant", "content": str}]`` — the conversational
format of TRL's GRPOTrainer. A conversation is rendered with the tokenizer's chat template
and the generation prompt (the opening of the assistant's turn), then tokenised without
adding special tokens again, so the template alone decides the prompt's tokens.
``model.chat_template`` replaces the tokenizer's template (a file path or the template
itself), and ``model.chat_template_kwargs`` are its extra variables at every rendering
(:func:`render_chat`, which every conversation of the policy goes through).
"""

from __future__ import annotations

from typing import Any

from asyncrl.errors import ConfigError
from asyncrl.models.chat_templates import CHAT_TEMPLATE_KWARGS
from asyncrl.types import Prompt

ROLES = ("system", "user", "assistant")


def message_error(messages: Any) -> str | None:
    """Why ``messages`` is not a usable conversation (None when it is)."""
    if not isinstance(messages, list) or not messages:
        return "a conversational 'prompt' must be a non-empty list of messages"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return f"message {i} must be an object with 'role' and 'content', got {m!r}"
        if m["role"] not in ROLES:
            return f"message {i} has role {m['role']!r}; allowed: {list(ROLES)}"
        if not isinstance(m["content"], str):
            return f"message {i} has a non-string 'content' ({type(m['content']).__name__})"
    if messages[-1]["role"] == "assistant":
        return "the last message is the assistant's; a prompt ends with a system or user message"
    return None


def conversation_label(messages: list[dict[str, str]]) -> str:
    """A short text for a conversation (its last user message), kept in ``Prompt.text``."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else messages[-1]["content"]


def make_prompt(prompt_id: str, value: Any, answer: Any, extra: dict[str, Any]) -> Prompt | str:
    """A :class:`Prompt` from a row's prompt value (string or messages), or the reason it is unusable."""
    if isinstance(value, list):
        reason = message_error(value)
        if reason is not None:
            return reason
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
        text = conversation_label(messages)
    elif isinstance(value, str) and value.strip():
        messages, text = None, value
    else:
        return "empty or non-string 'prompt' (a string or a list of messages is expected)"
    return Prompt(
        prompt_id=prompt_id,
        text=text,
        answer=None if answer is None else str(answer),
        extra=extra,
        messages=messages,
    )


def render_prompt(tokenizer, prompt: Prompt) -> str:
    """The text the policy continues: the string prompt, or the conversation through the chat template."""
    if prompt.messages is None:
        return prompt.text
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "model.chat_template",
            None,
            f"prompt {prompt.prompt_id} is a conversation but the tokenizer has no chat template; "
            "set model.chat_template to a template file or the template text",
        )
    return render_chat(tokenizer, prompt.messages, add_generation_prompt=True)


def render_chat(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    """``messages`` through the tokenizer's chat template, with ``model.chat_template_kwargs``
    (kept with the tokenizer when it was loaded) as the template's extra variables."""
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **getattr(tokenizer, CHAT_TEMPLATE_KWARGS, {}),
    )


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    return tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False).input_ids


def reward_prompt(prompt: Prompt) -> str | list[dict[str, str]]:
    """What reward functions receive as the prompt: the string, or the message list."""
    return prompt.text if prompt.messages is None else prompt.messages
