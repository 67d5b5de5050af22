"""The built-in toy world, a plugin (register.py): everything a laptop run needs and nothing downloads.

The arithmetic and chain tasks, the multi-turn games (calculator, guess) and their scripts
(scripted players whose episodes the warm starts train on), the verify episode, the warm starts
(``asyncrl sft``) and the shipped checkpoints they made (``models/``)."""
