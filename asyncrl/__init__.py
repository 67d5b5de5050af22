"""asyncrl: asynchronous reinforcement-learning post-training of language models.

The packages, in the order data flows (docs/design.md draws them):

* ``prompts`` — where prompts come from; ``builtin`` — the toy world (arithmetic, games,
  tiny models, the character tokenizer, warm starts);
* ``engine`` — token generation; ``rollout`` and ``episodes`` — prompts into scored groups;
  ``rewards`` — reward functions, their scoring, the reward pool and judges;
* ``control`` — the controller and what it decides with (books, buffer, steps, preemption);
* ``workers`` — the generator and trainer workers; ``runtimes`` — where workers live;
  ``transports`` — how weights and groups move between them;
* ``trainer`` and ``algorithms`` — the optimizer step and the losses; ``models`` — loading
  policies; ``server`` — the OpenAI-compatible server; ``reports`` — metrics and pictures.

Every package ``__init__`` is a docstring only: import names from their modules."""
