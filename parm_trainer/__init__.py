"""parm_trainer: Megatron-style MoE pretraining with Parm's dedicated communication schedules."""

__version__ = "0.1.0"
