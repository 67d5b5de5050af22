"""Pivot resampling (DEEP-GRPO, docs/pivots.md), section ``pivot`` of the config.

* :mod:`.success`: the success model that scores prefixes, and the pivots' branch weights;
* :mod:`.finding`: where a finished group's completions are worth branching (a generator's part);
* :mod:`.books`: the controller's part, the pivots found, their branch groups and their books;
* :mod:`.parts`: the workers' parts (a generator's :class:`~.parts.PivotFinder`, the trainer's
  :class:`~.parts.BranchSteps`).
"""
