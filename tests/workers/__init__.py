"""Tests of asyncrl/workers/."""
