"""Inference engines: token generation with per-token log-probs and policy versions."""
