"""Whether a parallel layout and model shape can run, checked before any process group starts.

Every check runs on every rank alike and with no communication, so an impossible layout ends all
ranks at once with one line naming the flag to change, instead of a hang inside the first
collective (docs/bad_input.md lists them). validate_layout also fills in the sizes the layout
implies (data-parallel size, global batch, micro-batches).
"""

from __future__ import annotations

import argparse
import math

from parm_trainer import node_relay
from parm_trainer.errors import LayoutError
from parm_trainer.planning.layout import check_interleaved_batch, check_pipeline


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise LayoutError(message)


def validate_layout(args: argparse.Namespace) -> None:
    """Check the parallel layout against the world size and the model; fill in derived sizes."""
    world, tp, pp = args.world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    for flag, size in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                       ("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
        _require(size >= 1, f"{flag} must be at least 1, got {size}")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "max_position_embeddings"):  # zero would divide by zero below or in megatron
        _require(getattr(args, name) >= 1,
                 f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.position_embedding_type == "learned_absolute":
        _require(args.seq_length <= args.max_position_embeddings,
                 f"--seq-length {args.seq_length} is longer than --max-position-embeddings "
                 f"{args.max_position_embeddings} (the learned position table)")
    _require(world % (tp * pp) == 0,
             f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} "
             f"does not divide the world size {world}")
    _require(world % (etp * ep * pp) == 0,
             f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} x "
             f"--pipeline-model-parallel-size {pp} = {etp * ep * pp} does not divide the world "
             f"size {world}")
    check_pipeline(args)
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    _require(args.kv_channels or args.hidden_size % args.num_attention_heads == 0,
             f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
             f"{args.num_attention_heads} (or give --kv-channels)")
    if args.group_query_attention:
        groups = args.num_query_groups
        _require(args.num_attention_heads % groups == 0,
                 f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                 f"--num-query-groups {groups}")
        _require(groups % tp == 0, f"--num-query-groups {groups} is not divisible by "
                                   f"--tensor-model-parallel-size {tp}")
    _require(args.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    if args.sequence_parallel:
        _require(args.seq_length % tp == 0,
                 f"--seq-length {args.seq_length} is not divisible by --tensor-model-parallel-size "
                 f"{tp} (needed by --sequence-parallel)")
    _validate_moe(args, tp, ep, etp)
    per_node = getattr(args, "ranks_per_node", None)
    _require(per_node is None or (per_node >= 1 and world % per_node == 0),
             f"--ranks-per-node {per_node} does not divide the world size {world}")
    args.data_parallel_size = world // (tp * pp)
    _validate_batch(args)
    check_interleaved_batch(args)


def _validate_moe(args, tp, ep, etp) -> None:
    experts = args.num_experts
    _require(experts is None or experts >= 1, "--num-experts must be at least 1")
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        _require(freq >= 1, "--moe-layer-freq must be at least 1")
    else:  # a list: one entry per layer (layer_pattern.moe_layer_freq checked the entries)
        _require(len(freq) == args.num_layers,
                 f"--moe-layer-freq lists {len(freq)} layers, --num-layers is {args.num_layers}")
    if experts is None:
        _require(ep == 1, "--expert-model-parallel-size > 1 needs --num-experts")
        return
    _require(experts % ep == 0,
             f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}")
    _require(1 <= args.moe_router_topk <= experts,
             f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts {experts}")
    _require(args.moe_expert_capacity_factor is None or args.moe_expert_capacity_factor > 0,
             f"--moe-expert-capacity-factor must be positive, got "
             f"{args.moe_expert_capacity_factor}")
    _require(args.moe_router_topk > 1 or args.moe_router_pre_softmax,
             "--moe-router-topk 1 needs --moe-router-pre-softmax: a softmax over the one chosen "
             "logit is 1 and gives the router no gradient")
    _require(args.moe_ffn_hidden_size % etp == 0,
             f"--moe-ffn-hidden-size {args.moe_ffn_hidden_size} is not divisible by "
             f"--expert-tensor-parallel-size {etp}")
    _require(etp == 1 or args.disable_bias_linear,
             f"expert biases need --expert-tensor-parallel-size 1 (got {etp}); "
             "add --disable-bias-linear")
    schedule = getattr(args, "moe_parm_schedule", "megatron")
    if schedule == "megatron" and tp > 1:
        # megatron-core's MoE dispatchers exchange sequence-parallel shards (TransformerConfig).
        _require(args.sequence_parallel, "MoE with --tensor-model-parallel-size > 1 and "
                 "--moe-parm-schedule megatron needs --sequence-parallel")
    if schedule == "baseline":
        # ESP ranks must hold the same tokens for the all-reduce of the expert shards' outputs
        _require(etp == tp,
                 f"--moe-parm-schedule baseline (DeepSpeed TED) needs --expert-tensor-parallel-size"
                 f" equal to --tensor-model-parallel-size (got {etp} and {tp})")
    if schedule == "s1" and not args.sequence_parallel:
        _require(args.seq_length % tp == 0,
                 f"--moe-parm-schedule s1 splits tokens over MP: --seq-length {args.seq_length} "
                 f"is not divisible by --tensor-model-parallel-size {tp}")
    if schedule == "s2" and getattr(args, "moe_parm_exchange", "padded") != "padded":
        tokens = args.seq_length * args.micro_batch_size
        _require(tokens % tp == 0,
                 f"--moe-parm-schedule s2 splits the tokens over MP: {tokens} tokens "
                 f"(--seq-length x --micro-batch-size) are not divisible by "
                 f"--tensor-model-parallel-size {tp}")
    elif schedule == "s2" and args.moe_expert_capacity_factor is not None:
        tokens = args.seq_length * args.micro_batch_size
        capacity = math.ceil(tokens * args.moe_router_topk * args.moe_expert_capacity_factor
                             / experts)
        _require(capacity % tp == 0,
                 f"--moe-parm-schedule s2 splits the capacity over MP: capacity {capacity} "
                 f"(--moe-expert-capacity-factor {args.moe_expert_capacity_factor}, "
                 f"{tokens} tokens, top-{args.moe_router_topk}, {experts} experts) is not "
                 f"divisible by --tensor-model-parallel-size {tp}")
    _require(getattr(args, "moe_parm_chunks", 1) >= 0,
             "--moe-parm-chunks must be at least 1 (or 0: chosen at start-up)")
    if getattr(args, "moe_parm_local_first", False):
        _require(schedule in ("auto", "s1", "s2") and local_first_applies(args),
                 "--moe-parm-local-first needs --moe-parm-schedule s1, s2 or auto with the "
                 "exact exchange in one hop (not --moe-parm-exchange padded, not relayed "
                 "through nodes) and --expert-model-parallel-size > 1")


def _validate_batch(args) -> None:
    _require(args.micro_batch_size >= 1, "--micro-batch-size must be at least 1")
    _require(args.global_batch_size is None or args.global_batch_size >= 1,
             "--global-batch-size must be at least 1")
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    _require(args.global_batch_size % per_step == 0,
             f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
             f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
    args.num_microbatches = args.global_batch_size // per_step
    if args.pipeline_model_parallel_size > 1:
        _require(args.num_microbatches >= 1, "pipeline parallelism needs at least one micro-batch")
    _validate_training_length(args)


def _validate_training_length(args) -> None:
    """The batch-size ramp-up against the layout, and the iterations of sample-based training
    (--train-samples), which follow from the global batch size and its ramp-up."""
    from parm_trainer.planning import batch_schedule  # megatron-core's ramp-up: when used

    ramp_problem = batch_schedule.problem(args)
    _require(ramp_problem is None, ramp_problem)
    if getattr(args, "train_samples", None) is not None:
        args.train_iters = batch_schedule.train_iters(args)
        _require(args.train_iters >= 1,
                 f"--train-samples {args.train_samples} is less than one global batch "
                 f"(--global-batch-size {args.global_batch_size})")


def local_first_applies(args) -> bool:
    """Whether --moe-parm-local-first changes this job's exchange: exact and in one hop, with
    an EP group to send to."""
    return (args.expert_model_parallel_size > 1 and args.moe_parm_exchange != "padded"
            and node_relay.relay_size(args, node_relay.ranks_per_node(args)) == 1)
