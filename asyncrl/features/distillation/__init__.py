"""On-policy distillation's teacher stage (docs/distillation.md), section ``distill`` of the config.

* :mod:`.books`: the controller's part, the queue of groups the teacher scores before they
  enter the buffer;
* :mod:`.parts`: the trainer's part (:class:`~.parts.TeacherScores`): groups taken once scored,
  the teacher's signal in the advantages, the step's reverse KL;
* :mod:`.training`: with ``distill.top_k``, the top-k divergence's term in the trainer's loss.

The teacher itself (a model that scores a student's tokens) is a worker: :mod:`asyncrl.distill`.
"""
