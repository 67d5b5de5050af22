"""Tests of asyncrl/engine/."""
