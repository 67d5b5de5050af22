"""Tests of asyncrl/rewards/."""
