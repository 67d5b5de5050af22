"""Tests of asyncrl/config/."""
