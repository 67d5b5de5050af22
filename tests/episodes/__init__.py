"""Tests of asyncrl/episodes/."""
