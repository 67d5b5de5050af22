"""Runtimes: where the workers live (this process, child processes, Ray actors) and how a
worker is served there (:mod:`.serving`): its command loop, its lifeline, its share of the CPU cores."""
