"""Prompts: where they come from (datasets, streams) and how conversations become tokens."""
