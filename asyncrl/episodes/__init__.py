"""Multi-turn episodes: environments and agent functions, token in / token out, run beside
each other on one engine (see :mod:`asyncrl.episodes.rollout`)."""
