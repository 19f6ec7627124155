"""Parm MoE layer: communication schedules as plans, collectives, cost model and executor."""
