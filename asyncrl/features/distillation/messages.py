"""The teacher stage's command and event (its stage's own: the core knows them as a command a
worker takes and a stage's :class:`~asyncrl.protocol.messages.ResultsReady`)."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.protocol.messages import ResultsReady
from asyncrl.types import Group


@dataclass
class Teach:
    """To the teacher stage: score these groups (those a resumed checkpoint carried unscored; in a
    run the generators deliver the teacher its groups themselves)."""

    groups: list[Group]


@dataclass
class Taught(ResultsReady):
    """The teacher scored these groups: its results are their :class:`~asyncrl.types.TeacherScores`."""
