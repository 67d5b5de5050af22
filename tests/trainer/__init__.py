"""Tests of asyncrl/trainer/."""
