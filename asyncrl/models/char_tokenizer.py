"""The built-in character-level tokenizer.

One token per printable ASCII character plus three specials. It is built with the
``tokenizers`` library and wrapped in a ``PreTrainedTokenizerFast`` so that it saves,
loads and behaves exactly like any Hugging Face tokenizer; nothing in asyncrl special-cases
it.

Its chat template is deliberately plain: a system message is its text and a newline, a
user message is its text, an assistant message is its text and EOS, and the generation
prompt adds nothing. A one-message conversation ``[{"role": "user", "content": "12+7="}]``
therefore renders to exactly the arithmetic prompt ``12+7=`` the tiny models were trained on.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] }}{{ '\\n' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ m['content'] }}{{ eos_token }}"
    "{%- else -%}{{ m['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
CHARACTERS = "".join(c for c in string.printable if c.isprintable() or c == "\n")


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A deterministic character tokenizer: ids 0..2 are specials, then one id per character."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Splitting on the empty pattern isolates every character, so WordLevel maps each one.
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
