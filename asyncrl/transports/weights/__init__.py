"""Moving versioned weights from the trainer to the engines: shared memory, broadcast, files."""
