"""On-policy distillation's panels of a run report (:mod:`asyncrl.reports.panels`)."""

from __future__ import annotations

from asyncrl.reports.panels import Panel

PANELS = (
    Panel(
        "distill", "On-policy distillation: reverse KL to the teacher, top-k divergence",
        ("distill_reverse_kl", "distill_top_k_kl"), "nats/token",
    ),
    Panel(
        "teacher_queue", "Teacher stage: groups waiting, generators held", ("teacher_queue", "teacher_full_s"),
        "groups / seconds",
    ),
)  # fmt: skip
