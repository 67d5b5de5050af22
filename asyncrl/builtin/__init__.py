"""The built-in toy world: everything a laptop run needs and nothing downloads.

The arithmetic and chain tasks, the multi-turn games (calculator, guess) and their scripted
teachers, the tiny Qwen2/Llama-style model configs, the character tokenizer, the warm starts
(``asyncrl sft``) and the shipped checkpoints they made (``models/``)."""
