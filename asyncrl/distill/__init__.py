"""On-policy distillation: a teacher scores the student's own tokens (``distill.*``).

The teacher stage (:class:`~asyncrl.features.distillation.stage.TeacherWorker`) sits between the
generators and the trainer; :mod:`.teacher` is the teacher it asks — a local model or a served
one (``asyncrl serve``'s ``POST /v1/logprobs``) — and the check that it shares the student's
tokenizer. The per-token signal it gives is in :mod:`asyncrl.algorithms.advantages`; :mod:`.top`
holds its top-k tokens (``distill.top_k``) and the divergence over them.
"""
