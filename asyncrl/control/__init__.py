"""Control: the controller loop and what it decides with.

The books (tickets and group ids), the rollout buffer and its admission control, step
assembly, a stop's preemption, the generators' membership, the step records, run checkpoints
and the run directory. Control sees headers and ids, never tokens."""
