"""The features asyncrl ships, each in a package of its own, plugged into the core through its hooks.

The core (the controller's books, the trainer worker, the generator worker, the runtimes)
names no feature: it declares hook points (:mod:`asyncrl.control.features` for the control
loop, :mod:`asyncrl.workers.features` for a trainer's steps and a generator's work) and calls
every registered part. A feature's package holds its controller part (``books``), its
workers' parts (``parts``) and the algorithm only it uses; its config section is a section of
:mod:`asyncrl.config`, its doc one page of docs/. :mod:`.shipped` registers them all (a
plugin, :mod:`asyncrl.plugins`).

* :mod:`.pivots`: DEEP-GRPO's pivot resampling (docs/pivots.md);
* :mod:`.distillation`: the teacher stage of on-policy distillation (docs/distillation.md);
* :mod:`.policies`: several policies, and a role's turns (docs/multi_agent.md);
* :mod:`.routing`: a mixture of experts' routes, recorded and replayed (docs/moe.md).
"""
