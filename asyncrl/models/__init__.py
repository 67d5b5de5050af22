"""Models: Hugging Face causal LMs from a local path (or a built-in name), LoRA adapters,
activation checkpointing."""
