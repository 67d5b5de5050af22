"""Tests of asyncrl/distill/."""
