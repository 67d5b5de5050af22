"""Tests of asyncrl/runtimes/."""
