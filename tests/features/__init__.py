"""Tests of asyncrl/features/."""
