"""Checkpoint conversion: the project's checkpoints to and from Hugging Face transformers."""
