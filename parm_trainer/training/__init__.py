"""The training loop around megatron-core: set-up, steps, evaluation, checkpoints, logging."""
