"""The shipped features' panels of a run report, registered in
:data:`~asyncrl.reports.panels.REPORT_PANELS`: the one registry ``asyncrl report`` reads, filled
by this module alone (it imports no model code, so a report does not load every feature's).
Each feature declares its panels in its own package (``panels.py``); a new feature adds its
line here."""

from __future__ import annotations

from asyncrl.features.critic import panels as critic
from asyncrl.features.distillation import panels as distillation
from asyncrl.features.pivots import panels as pivots
from asyncrl.features.policies import panels as policies
from asyncrl.features.routing import panels as routing
from asyncrl.reports.panels import REPORT_PANELS

for feature in (distillation, pivots, routing, policies, critic):
    for panel in feature.PANELS:
        REPORT_PANELS.register(panel.slug, panel)
