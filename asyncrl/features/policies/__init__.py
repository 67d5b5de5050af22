"""Several policies and roles (docs/multi_agent.md), section ``multi_agent`` of the config.

* :mod:`.books`: the controller's part, each policy's books, clock and share of a step;
* :mod:`.parts`: the trainer's part (:class:`~.parts.RoleTurns`: each turn of a role its own
  advantage, ``multi_agent.advantage=role_turn``).
"""
