"""Rank worker of tests/test_moe_features.py: Parm's layer against megatron-core's MoELayer.

For each layout and each feature set (the routing and shared-expert flags of
parm_trainer/moe_flags.py), megatron's MoELayer is built from the TransformerConfig of those
flags (with --sequence-parallel where MP > 1, which it needs) and Parm's layer under every
schedule, depth and exchange from the same config; each Parm layer gets megatron's weights
(state_dict: the same names, so the same checkpoint), runs forward and backward on the same
input and output gradient, and must give megatron's output, input gradient, router, expert and
shared-expert gradients and tracked router losses (1e-5 relative to the largest value).
Gradients that megatron leaves as partial sums over TP (parameters marked sequence_parallel)
are summed over TP first, as finalize_model_grads does. With a capacity factor, megatron's
layer under sequence parallelism gates each MP rank's sequence shard: only a schedule that
gates the same shards (s1, or any schedule where MP = 1) counts capacity alike.
The expert bias: 5 rounds of forward, backward and megatron-core's own bias update on both
layers must leave the same bias.
"""

import torch
from megatron.core.distributed.finalize_model_grads import (_update_router_expert_bias,
                                                            reset_model_temporary_tensors)
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from parm_trainer.arguments import parse_args
from parm_trainer.bench.harness import build_layer
from parm_trainer.bench.layout import gather_mp, set_layout
from parm_trainer.compat import cpu
from parm_trainer.models.config import transformer_config

HANG_S = 600
SEQ, MBS, HIDDEN, FFN, EXPERTS = 16, 2, 32, 32, 8
TOL = 1e-5

BASE = ["--num-experts", str(EXPERTS), "--moe-router-topk", "4", "--hidden-size", str(HIDDEN),
        "--moe-ffn-hidden-size", str(FFN), "--seq-length", str(SEQ), "--micro-batch-size",
        str(MBS), "--disable-bias-linear", "--num-attention-heads", "4",
        "--moe-aux-loss-coeff", "0.1", "--moe-parm-tune-cache", "none"]
SIGMOID = ["--moe-router-score-function", "sigmoid"]
DEEPSEEK = [*SIGMOID, "--moe-router-enable-expert-bias", "--moe-router-num-groups", "4",
            "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5",
            "--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-dtype", "fp32"]
FEATURES = {
    "sigmoid": SIGMOID,
    "expert_bias": [*SIGMOID, "--moe-router-enable-expert-bias"],
    "groups": ["--moe-router-num-groups", "4", "--moe-router-group-topk", "2"],
    "scaling": [*SIGMOID, "--moe-router-topk-scaling-factor", "2.5"],
    "router_fp64": ["--moe-router-dtype", "fp64", "--moe-z-loss-coeff", "0.01"],
    "shared": ["--moe-shared-expert-intermediate-size", "48"],
    "shared_gate": ["--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate"],
    "seq_aux_loss": ["--moe-router-load-balancing-type", "seq_aux_loss"],
    "global_aux_loss": ["--moe-router-load-balancing-type", "global_aux_loss"],
    "deepseek": DEEPSEEK,
    "deepseek_capacity": [*DEEPSEEK, "--moe-expert-capacity-factor", "1.0"],
}
# (MP, EP, ESP, SP for Parm's rows): megatron's layer always runs with SP where MP > 1
LAYOUTS = {1: [(1, 1, 1, False)],
           2: [(1, 2, 1, False), (2, 1, 2, True), (2, 2, 1, False)],
           4: [(1, 1, 1, False), (1, 4, 1, False), (2, 2, 2, True), (2, 2, 1, False),
               (2, 1, 2, False)],
           8: [(2, 2, 2, True), (1, 8, 1, False)]}
# beyond 4 ranks, and on 2: the combination, dropless and with a capacity factor, and the
# shared expert with its gate
FEW = ("deepseek", "deepseek_capacity", "shared_gate")
# Parm's rows: (schedule, depth, exchange, shared expert overlapped)
ROWS = [("s1", 1, "exact", False), ("s1", 2, "exact", True), ("s1", 4, "exact", False),
        ("s1", 2, "padded", True), ("s1", 2, "direct", False), ("s2", 1, "exact", True),
        ("s2", 2, "exact", False), ("s2", 4, "padded", False), ("baseline", 1, "padded", False)]
LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
          "z_loss")


def layout_args(mp, ep, esp, sp, extra, world):
    return parse_args([*BASE, *extra, "--tensor-model-parallel-size", str(mp),
                       "--expert-model-parallel-size", str(ep),
                       "--expert-tensor-parallel-size", str(esp),
                       *(["--sequence-parallel"] if sp else [])], world_size=world)


def inputs(round_):
    generator = torch.Generator().manual_seed(100 + round_)
    x = torch.randn(SEQ, MBS, HIDDEN, generator=generator)
    return x, torch.randn(SEQ, MBS, HIDDEN, generator=generator)


def local(full, sp):
    from megatron.core import parallel_state

    if not sp:
        return full
    size, rank = (parallel_state.get_tensor_model_parallel_world_size(),
                  parallel_state.get_tensor_model_parallel_rank())
    return full.chunk(size, dim=0)[rank].contiguous()


def run(layer, sp, round_=0):
    """One forward and backward: {name: tensor} of what is compared."""
    from megatron.core import parallel_state

    layer.zero_grad()
    moe_utils.clear_aux_losses_tracker()
    full_x, full_g = inputs(round_)
    x = local(full_x, sp).requires_grad_(True)
    out = layer(x)[0]
    (out * local(full_g, sp)).sum().backward()
    got = {"output": gather_mp(out.detach(), sp), "input_grad": gather_mp(x.grad, sp)}
    tp = parallel_state.get_tensor_model_parallel_group()
    for name, param in layer.named_parameters():
        grad = param.grad.detach().clone()
        if getattr(param, "sequence_parallel", False):
            torch.distributed.all_reduce(grad, group=tp)
        got[name] = grad
    names = [n for n in LOSSES if n in moe_utils.get_moe_layer_wise_logging_tracker()]
    moe_utils.reduce_aux_losses_tracker_across_ranks(names)
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    for name in names:
        values = tracker[name]["values"].clone()
        if name == "z_loss":  # megatron tracks each rank's own tokens' mean: the MP mean
            torch.distributed.all_reduce(values, group=tp, op=torch.distributed.ReduceOp.AVG)
        got[name] = values
    return got


def compare(got, want, case, report):
    assert got.keys() == want.keys(), (case, sorted(got), sorted(want))
    for key in want:
        scale = max(want[key].abs().max().item(), 1e-12)
        diff = (got[key].float() - want[key].float()).abs().max().item()
        assert diff <= TOL * scale, (case, key, diff, scale)
        report["checks"] += 1


def rows_for(mp, extra):
    capacity = "--moe-expert-capacity-factor" in extra
    for schedule, depth, exchange, overlap in ROWS:
        if capacity and mp > 1 and schedule != "s1":
            continue  # drops counted per gate call: megatron's layer gates sequence shards
        yield schedule, depth, exchange, overlap


def check_features(report, world):
    features = FEATURES if world in (1, 4) else {name: FEATURES[name] for name in FEW}
    for mp, ep, esp, sp in LAYOUTS[world]:
        for feature, extra in features.items():
            megatron_args = layout_args(mp, ep, esp, mp > 1, extra, world)
            set_layout(megatron_args)
            reference = build_layer("megatron", transformer_config(megatron_args),
                                    megatron_args)
            if "expert_bias" in feature or feature == "deepseek":
                with torch.no_grad():  # a bias that changes the routing, the same on every rank
                    reference.router.expert_bias.copy_(
                        torch.randn(EXPERTS, generator=torch.Generator().manual_seed(3)) * 0.1)
            reference.train()
            want = run(reference, mp > 1)
            for schedule, depth, exchange, overlap in rows_for(mp, extra):
                if schedule == "baseline" and esp != mp:
                    continue  # DeepSpeed's TED: ESP is MP
                args = layout_args(mp, ep, esp, sp, extra, world)
                args.moe_parm_schedule, args.moe_parm_chunks = schedule, depth
                args.moe_parm_exchange = exchange
                args.moe_shared_expert_overlap = overlap
                layer = build_layer(schedule, transformer_config(args), args)
                missing = layer.load_state_dict(reference.state_dict(), strict=True)
                assert not missing.missing_keys and not missing.unexpected_keys, missing
                layer.train()
                case = (f"MP{mp} EP{ep} ESP{esp}{' SP' if sp else ''} {feature} "
                        f"{schedule}/r{depth}/{exchange}{'/overlap' if overlap else ''}")
                compare(run(layer, sp), want, case, report)
                report["cases"].append(case)


def check_expert_bias(report, world):
    """5 rounds of forward, backward and megatron's bias update on megatron's layer and on
    Parm's default schedules: the same bias, which moved."""
    mp, ep, esp, _ = next((layout for layout in LAYOUTS[world] if layout[0] > 1),
                          LAYOUTS[world][0])
    for schedule in ("s1", "s2"):
        layers = {}
        for name in ("megatron", schedule):
            args = layout_args(mp, ep, esp, mp > 1, DEEPSEEK, world)
            args.moe_parm_schedule, args.moe_parm_chunks = name, 2
            set_layout(args)
            layers[name] = build_layer(name, transformer_config(args), args)
            layers[name].train()
        layers[schedule].load_state_dict(layers["megatron"].state_dict())
        config = layers["megatron"].config
        for round_ in range(5):
            for layer in layers.values():
                run(layer, mp > 1, round_)
                _update_router_expert_bias([layer], config)
                reset_model_temporary_tensors(config, [layer])
        want = layers["megatron"].router.expert_bias
        got = layers[schedule].router.expert_bias
        assert want.abs().max().item() > 0, "the bias never moved"
        assert torch.equal(got, want), (schedule, got, want)
        report["checks"] += 1


def check_forced_balancing(report, world):
    """--moe-router-force-load-balancing: the MP ranks that gate the same tokens (s2, the
    baseline) route on the same random logits, so their outputs agree; s1 runs; the router's
    weight still gets its gradient (straight through)."""
    mp, ep, esp, sp = LAYOUTS[world][2] if world == 4 else LAYOUTS[world][0]
    outs = {}
    for schedule in ("s2", "baseline", "s1"):
        if schedule == "baseline" and esp != mp:
            continue
        args = layout_args(mp, ep, esp, sp, ["--moe-router-force-load-balancing"], world)
        args.moe_parm_schedule, args.moe_parm_chunks = schedule, 2
        args.moe_parm_exchange = "padded" if schedule == "baseline" else "exact"
        set_layout(args)
        layer = build_layer(schedule, transformer_config(args), args)
        layer.train()
        outs[schedule] = run(layer, sp)
        assert outs[schedule]["router.weight"].abs().max().item() > 0, schedule
        report["checks"] += 1
    if "baseline" in outs:
        compare({"output": outs["s2"]["output"]}, {"output": outs["baseline"]["output"]},
                f"forced balancing MP{mp} s2 vs baseline", report)


def main(report):
    cpu.apply()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else int(
        __import__("os").environ["WORLD_SIZE"])
    report["cases"] = []
    check_features(report, world)
    check_expert_bias(report, world)
    if world in (1, 4):
        check_forced_balancing(report, world)


if __name__ == "__main__":
    import os.path
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: rank_main
    import rank_main

    rank_main.run(main, HANG_S)
