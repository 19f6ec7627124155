"""The model's pieces priced with seconds measured on this machine (args.layer_times, from
schedule/layer_times.py) instead of the profile's compute prices.

Measured under the layout being priced (training's start-up measures the run's own): each
piece's forward and backward are the measured seconds, its MP collectives and MoE exchange
included, as they ran.
Measured under another (tools/plan_layout.py: one rank, TP = EP = 1, pricing every layout): a
piece's communication is the profile's (its price with compute nearly free), and its compute
(its price less that) is the measured seconds times the ratio of its compute priced under this
layout to its compute priced under the measured one: the profile says how the work shrinks
with TP and EP, the measurement what it costs here. A piece the profile gives no compute (the
embedding's lookup without a memory rate) keeps its measured seconds.
Either way the P2P transfers between stages and the gradient reduction stay the profile's
(stages.py, ModelCost.gradient_sync_s).
"""

from __future__ import annotations

import copy
from dataclasses import replace

FREE = 1e-9  # the compute factor that leaves a price's communication


def same_layout(args, layout: dict) -> bool:
    sp = bool(args.sequence_parallel and args.tensor_model_parallel_size > 1)
    return layout == {"tp": args.tensor_model_parallel_size,
                      "ep": args.expert_model_parallel_size,
                      "esp": args.expert_tensor_parallel_size, "sp": sp}


def _by_kind(cost, args, profile, schedule=None) -> tuple:
    """({kind: piece} priced with profile alone under args' layout, the MoE choice)."""
    plain = type(cost)(args, profile, schedule)
    plain.layer_times = None
    pieces = {p.kind: p for p in plain.pieces()}
    choice = plain.moe_choice and (plain.moe_choice[0], int(plain.moe_choice[1][1:]))
    return pieces, choice


def _measured_layout(args, layout: dict):
    ref = copy.copy(args)
    ref.tensor_model_parallel_size, ref.expert_model_parallel_size = layout["tp"], layout["ep"]
    ref.expert_tensor_parallel_size, ref.sequence_parallel = layout["esp"], layout["sp"]
    return ref


def priced_with_times(cost, pieces: list) -> list:
    """pieces (cost's, priced with its profile) with cost.layer_times' seconds in place of the
    compute prices, scaled by cost.time_factor (ModelCost.scaled)."""
    seconds, layout = cost.layer_times["seconds"], cost.layer_times["layout"]
    factor = cost.time_factor
    if same_layout(cost.args, layout):
        return [_with_recompute(p, seconds[p.kind][0] * factor, seconds[p.kind][1] * factor)
                if p.kind in seconds else p for p in pieces]
    choice = cost.moe_choice and (cost.moe_choice[0], int(cost.moe_choice[1][1:]))
    comm, _ = _by_kind(cost, cost.args, cost.profile.scaled_compute(FREE), choice)
    ref_args = _measured_layout(cost.args, layout)
    ref, ref_choice = _by_kind(cost, ref_args, cost.profile)
    ref_comm, _ = _by_kind(cost, ref_args, cost.profile.scaled_compute(FREE), ref_choice)

    def plain(piece, field: str) -> float:  # without selective recompute's forward again
        return getattr(piece, field) - (piece.recompute_s if field == "backward_s" else 0.0)

    def one(p, d: int, field: str) -> float:
        here = plain(p, field) - plain(comm[p.kind], field)
        there = plain(ref[p.kind], field) - plain(ref_comm[p.kind], field)
        measured = seconds[p.kind][d] * factor
        return plain(comm[p.kind], field) + (measured * here / there if there > 0 else
                                             measured)

    return [_with_recompute(p, one(p, 0, "forward_s"), one(p, 1, "backward_s"))
            if p.kind in seconds else p for p in pieces]


def _with_recompute(p, forward_s: float, backward_s: float):
    """p with measured seconds (taken without recomputation, layer_times._trial) and
    selective recompute's forward again (p.recompute_s, the profile's price) scaled as the
    measured forward is to the profile's."""
    again = p.recompute_s * forward_s / p.forward_s if p.forward_s > 0 else p.recompute_s
    return replace(p, forward_s=forward_s, backward_s=backward_s + again, recompute_s=again)
