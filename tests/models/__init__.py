"""Tests of asyncrl/models/."""
