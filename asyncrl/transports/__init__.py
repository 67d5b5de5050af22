"""Transports: what crosses between workers. ``weights`` — versioned weights from the trainer
to the generators; ``groups`` — generated groups from the generators to the trainer."""
