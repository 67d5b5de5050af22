"""Tests of asyncrl/builtin/."""
