"""Pure functions on tensors: advantages, policy losses, KL, aggregation. No I/O, no distributed."""
