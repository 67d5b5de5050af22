"""Tests of asyncrl/reports/."""
