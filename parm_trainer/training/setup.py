"""Build the model chunks, their DDP wrappers, the megatron optimizer and the LR schedule."""

from __future__ import annotations

from typing import Callable

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig

from parm_trainer.models.init import init_weights_layout_free
from parm_trainer.moe.layer import expert_comm_explicit, mlp_recompute_to_parm
from parm_trainer.training.lr_schedule import build_scheduler
from parm_trainer.training import loss_scale
from parm_trainer.training.node_buckets import ByNode
from parm_trainer.training.paced_reduction import PacedBucket
from parm_trainer.training.tied_embedding import (
    TiedEmbeddingGrad, bucket_size_isolating, tied_word_embedding)

# model_provider(args, config, pre_process, post_process[, vp_stage=i]) -> megatron module;
# vp_stage is passed under interleaved 1F1B only (as Megatron-LM's get_model does)
ModelProvider = Callable[..., torch.nn.Module]


def mark_expert_params(module: torch.nn.Module) -> int:
    """Flag every expert weight `allreduce = False`, whatever the EP size.

    megatron-core (tensor_parallel/layers.py, `self.expert_parallel = config.
    expert_model_parallel_size > 1`) marks expert weights only when EP > 1; with EP = 1 they
    land in DDP's dense buffers and are reduced over the dense data-parallel group. That group is
    wrong whenever ESP differs from MP (e.g. TP2 with ESP1: each MP rank's expert replica sees
    its own sequence shard, and the replicas' gradients must be summed over the expert-data-
    parallel group). With the flag, DDP and the optimizer use the expert groups in every layout.
    """
    flagged = 0
    for sub in module.modules():
        if getattr(sub, "is_expert", False):
            for param in sub.parameters(recurse=False):
                param.allreduce = False
                flagged += 1
    return flagged


class DDP(DistributedDataParallel):
    """megatron-core's DDP; a tied word embedding's lookup gradient is reduced apart, after
    DDP's own reduction (tied_embedding.py), so that the weight's bucket can go early, paced
    between the MoE layers' exchanges (paced_reduction.py)."""

    tied_embedding = None
    paced_embedding = None  # the tied embedding's bucket reduced between the MoE exchanges

    def finish_grad_sync(self, *args, **kwargs):
        super().finish_grad_sync(*args, **kwargs)
        if self.tied_embedding is not None:
            self.tied_embedding.reduce()

    def zero_grad_buffer(self):
        super().zero_grad_buffer()
        if self.tied_embedding is not None:
            self.tied_embedding.kept.clear()  # of a step that did not finish


def _bucket_size(args, module) -> int | None:
    """--ddp-bucket-size, made to give a tied word embedding a bucket of its own when its
    gradient is reduced during the backward (it is then complete first)."""
    embedding = tied_word_embedding(module)
    if embedding is None or not args.overlap_grad_reduce:
        return args.ddp_bucket_size
    weight = embedding.weight
    if args.use_distributed_optimizer:  # megatron-core's own rule isolates it (padded buckets)
        weight.shared_embedding = True
        return args.ddp_bucket_size
    default = max(40_000_000, 1_000_000 * parallel_state.get_data_parallel_world_size())
    dense = [param for param in module.parameters() if param.requires_grad
             and getattr(param, "allreduce", True) and param.dtype == weight.dtype]
    return bucket_size_isolating(dense, weight, args.ddp_bucket_size or default)


def build_model(args, config: TransformerConfig, model_provider: ModelProvider) -> list:
    """This pipeline rank's model chunks (one, or V under interleaved 1F1B: chunk i is virtual
    stage i, with the embedding only on rank 0's first and the loss only on the last rank's
    last), weights drawn layout-free, each wrapped in DDP."""
    virtual = getattr(args, "virtual_pipeline_model_parallel_size", None)
    chunks = []
    for stage in range(virtual or 1):
        extra = {"vp_stage": stage} if virtual else {}
        module = model_provider(
            args, config,
            parallel_state.is_pipeline_first_stage(ignore_virtual=False, **extra),
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, **extra), **extra)
        if args.bf16 or args.fp16:  # as Megatron-LM's Float16Module: megatron builds norms and
            module.to(args.params_dtype)  # the position table in fp32, fp32 meeting 16-bit inputs
        init_weights_layout_free(module, args.seed, args.init_method_std, args.num_layers)
        mark_expert_params(module)
        expert_comm_explicit(module)
        mlp_recompute_to_parm(module)
        if torch.cuda.is_available():
            module.cuda(torch.cuda.current_device())
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,  # needs the distributed optimizer
            bucket_size=_bucket_size(args, module),
            use_distributed_optimizer=args.use_distributed_optimizer,
            check_for_nan_in_grad=False,  # the loop checks the loss on every rank instead
        )
        # megatron buckets the first chunk's gradients only (Megatron-LM's get_model)
        model = DDP(config=config, ddp_config=ddp_config, module=module,
                    disable_bucketing=stage > 0)
        model.tied_embedding = TiedEmbeddingGrad.attach(model)
        if model.tied_embedding is not None:
            model.paced_embedding = PacedBucket.attach(model, model.tied_embedding.weight)
        ByNode.attach(model, skip=[model.paced_embedding.group] if model.paced_embedding else [])
        model.broadcast_params()
        chunks.append(model)
    return chunks


def build_optimizer(args, model: list, timers=None):
    opt_config = OptimizerConfig(
        timers=timers,
        barrier_with_L1_time=args.barrier_with_L1_time,
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        params_dtype=args.params_dtype,
        use_distributed_optimizer=args.use_distributed_optimizer,
        **loss_scale.optimizer_fields(args),
    )
    optimizer = loss_scale.one_scaler(get_megatron_optimizer(opt_config, model))
    return optimizer, build_scheduler(args, optimizer)  # counting samples, as Megatron-LM


def wire_config(config: TransformerConfig, model: list, optimizer) -> None:
    """The hooks megatron's pipeline schedules call: grad finalisation, loss scale, no_sync."""
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ([chunk.no_sync for chunk in model] if len(model) > 1
                           else model[0].no_sync)
