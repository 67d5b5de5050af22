"""Tests of asyncrl/transports/."""
