"""Several policies and roles (docs/multi_agent.md), section ``multi_agent`` of the config.

* :mod:`.books`: the controller's part, each policy's books, clock and share of a step;
* :mod:`.parts`: the trainer's part (:class:`~.parts.RoleTurns`: each turn of a role its own
  advantage, ``multi_agent.advantage=role_turn``);
* :mod:`.trainer`: the trainer worker's models, a trainer per policy driven as one
  (:class:`~.trainer.PolicySet`);
* :mod:`.engines`: a generator's models, an engine per policy, each at its own clock;
* :mod:`.weights`: how every policy's weights and clocks travel in one weight sync;
* :mod:`.start`: the check at the start that a policy's own model shares the run's tokenizer.
"""
