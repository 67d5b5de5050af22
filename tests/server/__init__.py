"""Tests of asyncrl/server/."""
