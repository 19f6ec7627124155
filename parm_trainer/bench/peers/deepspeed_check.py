"""tools/deepspeed_peer.py --check: DeepSpeed's three modes against the reference on a tiny
layer, on every layout each can run, top-2 and top-1 (4 ranks; one line per mode and layout).
Where DeepSpeed defines the aux loss otherwise (top-2: GShard's), the line also gives the
difference to DeepSpeed's own definition ([ds-def])."""

from __future__ import annotations

import os

import torch

from parm_trainer.bench import flags
from parm_trainer.bench.layout import device, gather_mp, max_over_ranks, set_layout
from parm_trainer.bench.peers import PeerCannotRun
from parm_trainer.bench.peers.deepspeed import MODES, apply_adapters, available, build, forward
from parm_trainer.bench.replica import Replica, output_diffs
from parm_trainer.bench.weights import full_weights

CHECK_MODEL = ["--num-experts", "4", "--hidden-size", "32", "--moe-ffn-hidden-size", "64",
               "--seq-length", "16", "--micro-batch-size", "2", "--moe-aux-loss-coeff", "0"]
# (label, MP, EP, ESP, sequence parallel, seed, modes); the first is the layout, for
# every mode. Seed 1 gives TED an odd dropless capacity at top-2 (21: adapter 3 is needed).
CHECK_LAYOUTS = [("MP2 EP2 ESP2", 2, 2, 2, False, 1234, MODES),
                 ("MP2 EP2 ESP2 SP", 2, 2, 2, True, 1234, ("ted",)),
                 ("MP2 EP2 ESP2 s1", 2, 2, 2, False, 1, ("ted",)),
                 ("MP2 EP2 ESP1", 2, 2, 1, False, 1234, ("dedup",)),
                 ("MP2 EP2 ESP1 SP", 2, 2, 1, True, 1234, ("dedup",)),
                 ("MP1 EP2 ESP1", 1, 2, 1, False, 1234, ("ep",))]


def _deepspeed_aux(replica, k):
    """DeepSpeed's aux loss where it differs from reference.py's (deepspeed.py's docstring):
    for k=2 the GShard aux loss E * sum_e mean_t(scores_e) * (first-choice count_e / T);
    else None."""
    if k != 2:
        return None
    s, b, m = replica.input.shape
    x, gate = replica.input.reshape(s * b, m), replica.weights["gate"]
    scores = torch.softmax(x @ gate.t(), dim=-1)
    first = torch.nn.functional.one_hot(scores.argmax(dim=1), gate.shape[0]).float()
    return gate.shape[0] * (scores.mean(dim=0) * first.mean(dim=0)).sum()


def _grad_diffs(layer, ref):
    """Gate grad (the full replica's on every MP rank: summed over DP only) and expert shards
    (summed over the expert-data-parallel group) against the reference's, summed over DP."""
    from megatron.core import parallel_state

    gate = layer.deepspeed_moe.gate.wg.weight.grad.detach().clone()
    torch.distributed.all_reduce(gate, group=parallel_state.get_data_parallel_group())
    d_gate = (gate - ref["gate_grad_total"]).abs().max().item()
    d_expert = 0.0
    edp = parallel_state.get_expert_data_parallel_group()
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    for expert, (e, rows) in zip(experts, layer.parm_peer["shards"]):
        for param, want in ((expert.fc1.weight, ref["fc1_grad_total"][e, rows, :]),
                            (expert.fc2.weight, ref["fc2_grad_total"][e, :, rows])):
            grad = param.grad.detach().clone()
            torch.distributed.all_reduce(grad, group=edp)
            d_expert = max(d_expert, (grad - want).abs().max().item())
    return d_gate, d_expert


def _argv(mp, ep, esp, sp, seed, k):
    argv = CHECK_MODEL + ["--tensor-model-parallel-size", str(mp),
                          "--expert-model-parallel-size", str(ep),
                          "--expert-tensor-parallel-size", str(esp),
                          "--moe-router-topk", str(k), "--seed", str(seed)]
    if sp:
        argv.append("--sequence-parallel")
    if k == 1:
        argv.append("--moe-router-pre-softmax")
    return argv


def _mode_line(head, mode, args, weights, replica, ref, gshard, sp):
    """One mode's line: every difference to the reference, max over ranks."""
    try:
        layer = build(mode, args, weights, device())
    except PeerCannotRun as error:
        return f"{head} cannot run: {error}"
    x = replica.local(replica.input, sp).requires_grad_()
    out, aux = forward(layer, x)
    (out * replica.local(replica.output_grad, sp)).sum().backward()
    diffs, _ = output_diffs(gather_mp(out.detach(), sp), gather_mp(x.grad, sp), ref)
    diffs = [diffs["output"], diffs["input_grad"], *_grad_diffs(layer, ref),
             (aux.detach() - ref["aux_loss"]).abs().item()]
    if gshard is not None:
        diffs.append((aux.detach() - gshard).abs().item())
    diffs = [max_over_ranks(v) for v in diffs]
    return (f"{head} out {diffs[0]:.1e}  in_grad {diffs[1]:.1e}  gate_grad {diffs[2]:.1e}  "
            f"expert_grad {diffs[3]:.1e}  aux {diffs[4]:.1e}"
            + (f"  [ds-def aux {diffs[5]:.1e}]" if gshard is not None else ""))


def check() -> int:
    from parm_trainer.compat import cpu
    from parm_trainer.planning.checks import validate_layout

    cpu.apply()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ok, reason = available()
    lines = [f"deepspeed_peer --check: {reason}; world {world}; E 4, M 32, H 64, 32 tokens, "
             f"fp32, dropless, aux coeff 0; adapters: {', '.join(apply_adapters())}",
             "max abs diff to reference.py (max over ranks): output, input grad, gate grad, "
             "expert grads, aux (raw); [ds-def]: to DeepSpeed's definition where it differs"]
    for label, mp, ep, esp, sp, seed, modes in CHECK_LAYOUTS:
        for k in (2, 1):
            args = flags.parse(_argv(mp, ep, esp, sp, seed, k), world_size=world)
            validate_layout(args)
            set_layout(args)
            weights = full_weights(args)
            replica = Replica(args, weights, device())
            ref = replica.reference(1)
            gshard = _deepspeed_aux(replica, k)
            for mode in modes:
                lines.append(_mode_line(f"{label:15s} top-{k} {mode:5s}", mode, args, weights,
                                        replica, ref, gshard, sp))
        lines.append(f"{'':15s} reference max abs: out {ref['output'].abs().max().item():.1e}, "
                     f"in_grad {ref['input_grad'].abs().max().item():.1e}, aux "
                     f"{ref['aux_loss'].item():.3f} (top-1)")
    if torch.distributed.get_rank() == 0:
        print("\n".join(lines), flush=True)
    torch.distributed.barrier()
    return 0
