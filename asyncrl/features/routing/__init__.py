"""Keep Routing (``trainer.routing_replay``): a mixture of experts' routes, recorded where tokens
are sampled and replayed where they are trained (docs/moe.md).

* :mod:`.routers`: the patched routers of one model (record, force, compare, count);
* :mod:`.routes`: routes on the wire, as samples carry them;
* :mod:`.record`: routes as a per-token record the engine keeps and the trainer reads back
  (:mod:`asyncrl.models.token_records`);
* :mod:`.training`: the trainer's part: replay switched on, the step's counts and metrics,
  the check of carried routes (:mod:`asyncrl.trainer.features`);
* :mod:`.start`: the check at the start of a run that the model's routers can be replayed.
"""
