"""bench_moe_layer's flags: Megatron-LM's (parm_trainer.arguments) and the tool's own, parsed
for the command line and for every entry of --configs alike.

Rows: --schedules (Parm's baseline, s1, s2, auto, and any peer) and then --peers (megatron-core's
dispatchers, "deepspeed" for DeepSpeed's three modes; peers/__init__.py). A row s1/rN or s2/rN
is that schedule at pipeline depth N whatever --moe-parm-chunks says, so one launch can time
every depth with auto and the peers, their iterations interleaved; a Parm row ending in
/shared-overlap (or /shared-before) runs the shared expert overlapped with the exchange (or
before the gate): s1/r2/shared-overlap.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from parm_trainer.arguments import parse_args
from parm_trainer.bench import peers
from parm_trainer.bench.features import beyond_reference
from parm_trainer.moe.reference import ACTIVATION, ROUTER

PARM = ("baseline", "s1", "s2", "auto")
SCHEDULE_NAMES = (*PARM, *peers.NAMES)
DEFAULT_ROWS = "baseline,s1,s2,megatron"
DEPTH_ROW = re.compile(r"^(s1|s2)/r([1-9][0-9]*)(/local)?$")
# a Parm row with its shared expert before the gate or overlapped with the exchange
SHARED_ROW = re.compile(r"^(.+)/shared-(before|overlap)$")
TOOL_HELP = f"""\
bench_moe_layer: one MoE layer, forward and backward, under several schedules, each checked
against parm_trainer/moe/reference.py, timed, and its collectives' bytes counted.
Router:     logits = x @ gate.T; routing probabilities = {ROUTER} of each
            token (megatron-core's default: score function "softmax"), or with
            --moe-router-pre-softmax (needed for top-1) the softmax over all E logits at
            the top k; dropless unless --moe-expert-capacity-factor.
Activation: {ACTIVATION} (torch.nn.functional.gelu, megatron-core's default); no biases.
Aux loss:   coeff * E / (k * T^2) * sum_e count_e * sum_t softmax(logits)[t, e] (megatron-core's
            switch load-balancing loss). fp32 only."""


class ToolError(ValueError):
    """Flags the tool cannot run with; the message names them."""


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    parser.description = TOOL_HELP
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    g = parser.add_argument_group("bench_moe_layer")
    # Rows run at the depth given (--moe-parm-chunks, 1 unless given; 0: chosen as auto does),
    # not at the training default of a depth chosen at start-up.
    parser.set_defaults(moe_parm_chunks=1)
    g.add_argument("--nproc", type=int, default=None,
                   help="Start this many ranks on this machine (torchrun); without it the tool "
                        "is one rank of a job torchrun started.")
    g.add_argument("--schedules", default=None,
                   help=f"Comma-separated schedules to run, from {','.join(SCHEDULE_NAMES)} "
                        "and s1/rN, s2/rN (that schedule at pipeline depth N) "
                        f"(default {DEFAULT_ROWS}; with --peers: {','.join(PARM[:3])}). "
                        "One that cannot run the layout is reported as skipped, with the reason.")
    g.add_argument("--peers", default=None,
                   help="Comma-separated peers run after --schedules' rows: "
                        f"{','.join(peers.MEGATRON[1:])}, megatron (its dispatcher from "
                        "--moe-token-dispatcher-type), deepspeed (its ep, dedup and ted modes; "
                        "pip install .[peers]) or one of "
                        f"{','.join(peers.DEEPSPEED)}.")
    g.add_argument("--ratio-to", default="baseline",
                   help="The entry of --schedules the ratio column divides by (default baseline).")
    g.add_argument("--iters", type=int, default=10, help="Timed iterations (median reported).")
    g.add_argument("--warmup", type=int, default=2, help="Untimed iterations first.")
    g.add_argument("--json", default=None, metavar="OUT", help="Write the results here (rank 0).")
    g.add_argument("--step-times", action="store_true",
                   help="After the timed iterations, time each Parm row's plan steps as "
                        "--timing-log-level 2 does in training (--iters more iterations) and "
                        "print their sum beside the row's fwd+bwd.")
    g.add_argument("--dump", default=None, metavar="DIR",
                   help="Write full input, output gradient, weights and each schedule's output "
                        "and input gradient of data-parallel replica 0 here (torch.save).")
    g.add_argument("--inter-node-rate", default=None, metavar="RATE",
                   help="The rate of one node's network link, for the link-time floor column: "
                        "a tc rate (200mbit, 25mbps) or a profile JSON from "
                        "tools/calibrate_comm.py run across nodes (its node link AlltoAll rate).")
    # Hidden: a JSON file holding a list of {"name": ..., "argv": [...]}; every entry is run in
    # this one launch (the world size stays, the layout may change), --json gets {"runs": [...]}.
    g.add_argument("--configs", default=None, help=argparse.SUPPRESS)


def _names(value: str) -> list:
    return [s.strip() for s in value.split(",") if s.strip()]


def rows(args) -> list:
    """The rows to run, in order: --schedules', then --peers' (groups expanded, each once)."""
    schedules = _names(args.schedules if args.schedules is not None else
                       ",".join(PARM[:3]) if args.peers else DEFAULT_ROWS)
    unknown = [s for s in schedules if not _known(shared_row(s)[0])]
    if unknown or not schedules and not args.peers:
        raise ToolError(f"--schedules: unknown {unknown}; choose from {','.join(SCHEDULE_NAMES)} "
                        "or s1/rN, s2/rN (s1/rN/local, s2/rN/local)")
    extra = _names(args.peers or "")
    unknown = [p for p in extra if p not in peers.NAMES and p not in peers.GROUPS]
    if unknown or args.peers is not None and not extra:
        raise ToolError(f"--peers: unknown {unknown}; choose from "
                        f"{','.join((*peers.NAMES, *peers.GROUPS))}")
    return peers.expand(schedules + extra)


def _known(name: str) -> bool:
    return name in SCHEDULE_NAMES or name in peers.GROUPS or bool(DEPTH_ROW.match(name))


def shared_row(name: str):
    """(the row's name without a /shared-before or /shared-overlap suffix, whether that says
    overlapped; None without one): s1/r2/shared-overlap is s1 at depth 2 with the shared
    expert overlapped with the exchange."""
    match = SHARED_ROW.match(name)
    if match and (match.group(1) in PARM or DEPTH_ROW.match(match.group(1))):
        return match.group(1), match.group(2) == "overlap"
    return name, None


def depth_row(name: str):
    """(schedule, depth, local first) of a row s1/rN or s2/rN, or with /local (s1/r2/local:
    --moe-parm-local-first); None for any other row."""
    match = DEPTH_ROW.match(name)
    return (match.group(1), int(match.group(2)), bool(match.group(3))) if match else None


def parse(argv, world_size=None):
    # experts and router without biases, as the reference
    argv = ["--disable-bias-linear", *(sys.argv[1:] if argv is None else argv)]
    args = parse_args(argv, add_tool_args, world_size=world_size)
    args.schedule_list = rows(args)
    if args.iters < 0 or args.warmup < 0:
        raise ToolError("--iters and --warmup must not be negative")
    if args.swiglu:
        raise ToolError("--swiglu: the reference implements the gelu expert only")
    if args.fp16:  # the reference is rounded to the layer's dtype for --bf16 only (weights.py)
        raise ToolError("--fp16: the layer benchmark measures fp32 or --bf16 layers")
    if args.bf16 and any(name.startswith("deepspeed") for name in args.schedule_list):
        raise ToolError("--bf16: the DeepSpeed peers run in fp32 here")
    # today's MoE blocks: checked against megatron's row instead of the reference (features.py)
    args.beyond_reference = beyond_reference(args)
    if args.beyond_reference and any(name.startswith("deepspeed") for name in args.schedule_list):
        raise ToolError(f"{args.beyond_reference[0]}: the DeepSpeed peers have no such MoE "
                        "block; leave --peers deepspeed out")
    if args.moe_router_load_balancing_type == "none":
        args.moe_aux_loss_coeff = 0.0
    args.link_bytes_per_s = link_rate(args.inter_node_rate) if args.inter_node_rate else None
    if args.num_experts is None and not args.configs:
        raise ToolError("--num-experts is required")
    args.hidden_dropout = args.attention_dropout = 0.0
    return args


def link_rate(value: str) -> float:
    """Bytes per second of one node's link: a tc rate, or a calibrated profile's node link
    AlltoAll rate."""
    from parm_trainer.cluster.netns import RATE, rate_bytes_per_s

    if value.endswith(".json"):
        try:
            with open(value) as f:
                fit = json.load(f)["fit"]["alltoall"]["inter"]
            return float(fit["node_link_GBps"]) * 1e9
        except (OSError, KeyError, TypeError, ValueError) as error:
            raise ToolError(f"--inter-node-rate {value}: no node link rate in it ({error!r}); "
                            "calibrate across nodes with tools/calibrate_comm.py") from None
    if not RATE.match(value):
        raise ToolError(f"--inter-node-rate {value!r}: a rate such as 200mbit, or a profile JSON")
    return rate_bytes_per_s(value)
