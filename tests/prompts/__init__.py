"""Tests of asyncrl/prompts/."""
