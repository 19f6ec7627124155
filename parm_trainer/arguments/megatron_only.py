"""Megatron-LM flags that mean nothing on this stack, or ask for what it does not have.

A user arrives with a Megatron-LM script; its flags must never end in argparse's
"unrecognized arguments". Each flag here is accepted by the parser and then either

- has no effect: a kernel fusion, a library choice or a setting this stack always takes; it is
  logged once at start-up ("has no effect here: why"), or
- is refused before the process groups start, with one line saying it is not supported and
  what to use instead (FP8, CUDA graphs, DeepEP, offloading, ...).

A few take a value that is this stack's own behaviour (`--context-parallel-size 1`,
`--ckpt-format torch_dist`) and refuse the others. The rows below are data: the flag as
Megatron-LM spells it (megatron/training/arguments.py and the dataclasses behind it, tag
core_v0.16.1), what it takes, and the line. README's flags table is built from them.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple, Optional


class Row(NamedTuple):
    flag: str
    takes: int | str  # 0: a switch; 1: one value; "+": one or more values
    effect: str  # "none" (logged) or "refused"
    why: str  # the reason (no effect) or what to use instead (refused)
    fine: tuple = ()  # values that are this stack's own behaviour: accepted, nothing logged


_FUSION = "a kernel fusion choice; this stack picks its own kernels"
_NO_FP8 = "FP8 needs Transformer Engine on Hopper or Blackwell GPUs; use --bf16 or --fp16"
_NO_OFFLOAD = ("no activation offloading; lower --micro-batch-size or raise "
               "--pipeline-model-parallel-size")
_NO_GRAPHS = "no CUDA graphs; leave the flag out"
_NO_UPCYCLING = ("no upcycling of dense checkpoints; tools/checkpoint/convert.py imports "
                 "Mixtral-shaped MoE checkpoints")
_MOMENTS = ("the optimizer keeps its moments in fp32; lower precisions need Transformer "
            "Engine's precision-aware optimizer")
_PARM_EXCHANGE = ("use --moe-parm-schedule auto: Parm's exact exchange sends each token once "
                  "per EP rank and relays it across nodes, as DeepEP does")

ROWS = (
    # no effect: megatron-core's models, kernels and fusions, settings always on here
    Row("--use-mcore-models", 0, "none", "megatron-core's models are the only ones here "
        "(Megatron-LM ignores it too)"),
    Row("--no-masked-softmax-fusion", 0, "none", _FUSION),
    Row("--no-bias-gelu-fusion", 0, "none", _FUSION),
    Row("--no-bias-swiglu-fusion", 0, "none", _FUSION),
    Row("--no-bias-dropout-fusion", 0, "none", _FUSION),
    Row("--no-rope-fusion", 0, "none", _FUSION),
    Row("--no-persist-layer-norm", 0, "none", _FUSION),
    Row("--no-gradient-accumulation-fusion", 0, "none", _FUSION + " (gradients accumulate in "
        "megatron-core's fp32 main_grad buffers)"),
    Row("--cross-entropy-loss-fusion", 0, "none", _FUSION),
    Row("--cross-entropy-fusion-impl", 1, "none", _FUSION),
    Row("--moe-permute-fusion", 0, "none", _FUSION + " (Parm's exchange permutes the tokens)"),
    Row("--moe-router-fusion", 0, "none", _FUSION),
    Row("--use-flash-attn", 0, "none", "attention runs as --attention-backend says "
        "(Megatron-LM deprecates this flag for it)"),
    Row("--te-rng-track", 0, "none", "megatron-core's own RNG tracker is used (a Transformer "
        "Engine feature)"),
    Row("--grad-reduce-in-fp32", 0, "none", "gradients are always reduced in fp32 here"),
    Row("--auto-detect-ckpt-format", 0, "none", "checkpoints here have one format, torch_dist"),
    Row("--overlap-p2p-comm", 0, "none", "pipeline sends and receives overlap compute by "
        "default here (--no-overlap-p2p-communication turns it off)"),
    # one value is this stack's own behaviour, the others are refused
    Row("--context-parallel-size", 1, "refused", "no context parallelism "
        "(--context-parallel-size 1); split long sequences with --sequence-parallel",
        fine=("1",)),
    Row("--ckpt-format", 1, "refused", "checkpoints are megatron-core's torch_dist format "
        "(--ckpt-format torch_dist), which loads under any layout", fine=("torch_dist",)),
    Row("--num-distributed-optimizer-instances", 1, "refused", "one distributed optimizer "
        "instance over the data-parallel group (--num-distributed-optimizer-instances 1)",
        fine=("1",)),
    Row("--exp-avg-dtype", 1, "refused", _MOMENTS, fine=("fp32",)),
    Row("--exp-avg-sq-dtype", 1, "refused", _MOMENTS, fine=("fp32",)),
    Row("--cuda-graph-impl", 1, "refused", _NO_GRAPHS, fine=("none",)),
    # refused: what this stack does not have
    Row("--fp8", 1, "refused", _NO_FP8),
    Row("--fp8-format", 1, "refused", _NO_FP8),
    Row("--fp8-recipe", 1, "refused", _NO_FP8),
    Row("--fp8-param-gather", 0, "refused", _NO_FP8),
    Row("--moe-router-padding-for-fp8", 0, "refused", _NO_FP8),
    Row("--reuse-grad-buf-for-mxfp8-param-ag", 0, "refused", _NO_FP8),
    Row("--cuda-graph-scope", "+", "refused", _NO_GRAPHS),
    Row("--external-cuda-graph", 0, "refused", _NO_GRAPHS),
    Row("--tp-comm-overlap", 0, "refused", "tensor-parallel communication overlap needs "
        "Transformer Engine's userbuffers; --overlap-grad-reduce and "
        "--overlap-moe-expert-parallel-comm overlap what they can"),
    Row("--delay-wgrad-compute", 0, "refused", "no split weight-gradient computation; "
        "--overlap-moe-expert-parallel-comm overlaps the MoE exchange"),
    Row("--moe-enable-deepep", 0, "refused", _PARM_EXCHANGE),
    Row("--moe-flex-dispatcher-backend", 1, "refused", _PARM_EXCHANGE),
    Row("--fine-grained-activation-offloading", 0, "refused", _NO_OFFLOAD),
    Row("--offload-modules", "+", "refused", _NO_OFFLOAD),
    Row("--optimizer-cpu-offload", 0, "refused", "no optimizer offloading; "
        "--use-distributed-optimizer shards the optimizer state over data-parallel ranks"),
    Row("--use-precision-aware-optimizer", 0, "refused", _MOMENTS),
    Row("--moe-use-upcycling", 0, "refused", _NO_UPCYCLING),
    Row("--moe-upcycling-granularity", 1, "refused", _NO_UPCYCLING),
    Row("--distribute-saved-activations", 0, "refused", "the inputs that full recompute keeps "
        "stay whole on each tensor-parallel rank; --sequence-parallel splits them"),
    Row("--fake-init-process-group", 0, "refused", "no fake process groups; "
        "tools/plan_layout.py prices a layout without the GPUs"),
)
# their own namespace attributes: --overlap-p2p-comm must not meet the overlap_p2p_comm that
# --no-overlap-p2p-communication sets
_BY_DEST = {"megatron_only_" + row.flag[2:].replace("-", "_"): row for row in ROWS}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Every row, in a group of its own, absent from the namespace unless given."""
    g = parser.add_argument_group(
        "Megatron-LM flags with no effect here, or refused (one line each at start-up)")
    for dest, row in _BY_DEST.items():
        kind = ("has no effect here" if row.effect == "none" else
                "refused" if not row.fine else f"only {', '.join(row.fine)}")
        help_text = f"{kind}: {row.why}".replace("%", "%%")
        if row.takes == 0:
            g.add_argument(row.flag, action="store_true", dest=dest,
                           default=argparse.SUPPRESS, help=help_text)
        else:
            g.add_argument(row.flag, nargs=None if row.takes == 1 else "+", dest=dest,
                           default=argparse.SUPPRESS, metavar="VALUE", help=help_text)


def _given(args) -> list:
    """The rows whose flag is on the command line, with the value given."""
    return [(row, getattr(args, dest)) for dest, row in _BY_DEST.items() if hasattr(args, dest)]


def problem(args) -> Optional[str]:
    """The first refused flag given, as its one line; None if none."""
    for row, value in _given(args):
        if row.effect == "refused" and str(value) not in row.fine:
            shown = row.flag if row.takes == 0 else f"{row.flag} {_show(value)}"
            return f"{shown} is not supported here: {row.why}"
    if getattr(args, "moe_token_dispatcher_type", None) == "flex":
        return f"--moe-token-dispatcher-type flex is not supported here: {_PARM_EXCHANGE}"
    return None


def notes(args) -> list:
    """One line per flag given that has no effect here, to log once at start-up."""
    return [f"{row.flag} has no effect here: {row.why}" for row, _ in _given(args)
            if row.effect == "none"]


def _show(value) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)
