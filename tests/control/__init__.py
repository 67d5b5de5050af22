"""Tests of asyncrl/control/."""
