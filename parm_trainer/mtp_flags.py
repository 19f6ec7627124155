"""Megatron-LM's flags for multi-token prediction (DeepSeek-V3's MTP).

`--mtp-num-layers N` (TransformerConfig's mtp_num_layers, default None: no MTP) adds N
megatron-core MultiTokenPredictionLayers after the decoder, on the last pipeline stage: layer k
joins the hidden states of depth k-1 with the embedding of the tokens shifted k places
(enorm, hnorm, eh_proj), runs one transformer layer of the last decoder layer's spec (Parm's
MoE layer where that one is MoE) and a final norm, and predicts token i+k+1 through the shared
output layer. megatron-core's GPTModel adds their mean loss, times
`--mtp-loss-scaling-factor` (default 0.1), to the gradient; the log line shows each depth's
loss as "mtp_k loss" (MTPLossLoggingHelper). Megatron-LM's names, types and defaults (tag
core_v0.16.1: both come from TransformerConfig's fields).
"""

from __future__ import annotations

from typing import Optional

FLAG = "--mtp-num-layers"


def add_flags(parser) -> None:
    g = parser.add_argument_group("multi-token prediction")
    g.add_argument(FLAG, type=int, default=None,
                   help="Multi-token prediction layers after the decoder (DeepSeek-V3's MTP, "
                        "megatron-core's MultiTokenPredictionBlock on the last pipeline stage): "
                        "layer k predicts the token k+1 places ahead. Default None: no MTP.")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="Weight of the MTP loss: the mean of the MTP layers' losses, times "
                        "this, is added to the loss (megatron-core's GPTModel).")


def enabled(args) -> bool:
    return bool(getattr(args, "mtp_num_layers", None))


def num_layers(args) -> int:
    """The MTP layers (0 without MTP)."""
    return getattr(args, "mtp_num_layers", None) or 0


def config_fields(args) -> dict:
    """TransformerConfig's fields of these flags (none without MTP)."""
    if not enabled(args):
        return {}
    return dict(mtp_num_layers=args.mtp_num_layers,
                mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)


def problem(args) -> Optional[str]:
    """The first combination megatron-core or Megatron-LM refuse with MTP, as one line; None if
    none (the values' own ranges are flag_ranges.py's)."""
    if not enabled(args):
        return None
    n = args.mtp_num_layers
    if args.position_embedding_type != "rope":  # Megatron-LM's validate_args asserts it
        return (f"{FLAG} {n} needs --position-embedding-type rope (Megatron-LM takes MTP with "
                f"rope or no position embedding only)")
    if args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights:
        # the MTP stage keeps its own output layer weight beside the embedding copy, which
        # megatron-core's sharded_state_dict asserts against (language_module.py)
        return (f"{FLAG} {n} with --pipeline-model-parallel-size > 1 needs "
                f"--untie-embeddings-and-output-weights (megatron-core cannot tie the output "
                f"layer on the MTP stage)")
    if (getattr(args, "recompute_granularity", None) == "full"
            and getattr(args, "recompute_method", None) == "uniform"
            and (getattr(args, "recompute_num_layers", None) or 1) != 1):
        # megatron-core's MultiTokenPredictionLayer asserts it in its forward
        return (f"{FLAG} {n} with --recompute-method uniform needs --recompute-num-layers 1 "
                f"(megatron-core recomputes each MTP layer alone)")
    if getattr(args, "overlap_moe_expert_parallel_comm", False) and (
            n != 1 or args.pipeline_model_parallel_size == 1):
        # TransformerConfig.__post_init__'s asserts
        return (f"{FLAG} {n} with --overlap-moe-expert-parallel-comm: megatron-core takes one "
                f"MTP layer only, with --pipeline-model-parallel-size > 1")
    return None
