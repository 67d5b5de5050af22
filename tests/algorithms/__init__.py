"""Tests of asyncrl/algorithms/."""
