"""Compatibility layers between megatron-core and the machines parm_trainer runs on."""
