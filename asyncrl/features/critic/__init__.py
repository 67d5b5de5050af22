"""PPO's learned value model (``algorithm.advantage=gae``, the ``critic`` section; docs/critic.md).

* :mod:`.model`: the value model, a causal LM's decoder under a one-output head;
* :mod:`.training`: its part in the trainer — it values a step's samples before their
  advantages, is trained on the same micro-batches towards the GAE returns with a clipped
  value loss, steps its own optimizer after the policy's and is part of every checkpoint;
* :mod:`.parts`: GAE's options for the trainer worker's advantages;
* :mod:`.start`: its check at the start of a run (a ``critic.path`` of the policy's tokenizer);
* :mod:`.panels`: its panels of a run report.

GAE itself is a pure function of rewards, values and masks: :mod:`asyncrl.algorithms.gae`.
"""
