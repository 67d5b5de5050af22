"""The trainer: micro-batching, log-probs, loss, optimizer."""
