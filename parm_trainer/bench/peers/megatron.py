"""megatron-core's own MoELayer as a benchmark row: "megatron" with --moe-token-dispatcher-type,
"megatron-alltoall" and "megatron-allgather" with that dispatcher. It holds the same router and
expert modules as ParmMoELayer, so the harness loads, runs and checks it as it does Parm's rows;
its collectives are its own, outside the byte ledger (bytes null)."""

from __future__ import annotations

from parm_trainer.bench.peers import megatron_dispatcher


def configure(trial, name: str) -> None:
    """Set a row's args for megatron-core's layer (and the row's dispatcher, if it names one)."""
    trial.moe_parm_schedule = "megatron"
    dispatcher = megatron_dispatcher(name)
    if dispatcher:
        trial.moe_token_dispatcher_type = dispatcher


def build(config, submodules):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from parm_trainer.moe.layer import expert_comm_explicit

    layer = MoELayer(config, submodules, layer_number=1)
    expert_comm_explicit(layer.experts)  # as the training entries build it (biases, one rank)
    return layer


def describe(args) -> str:
    return f"megatron-core MoELayer ({args.moe_token_dispatcher_type} dispatcher)"
