"""Workers: the generator and the trainer, each taking commands and returning events.

A worker knows nothing of processes, queues or Ray; a runtime runs it."""
