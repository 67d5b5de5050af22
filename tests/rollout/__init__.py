"""Tests of asyncrl/rollout/."""
