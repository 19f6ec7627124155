"""The ranks' side of tests/test_tied_embedding.py (run by conftest.run_rank_workers)."""
import contextlib
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.moe import moe_utils
from parm_trainer.arguments import parse_args
from parm_trainer.compat import cpu
from parm_trainer.models.config import transformer_config
from parm_trainer.models.gpt import build_gpt_moe
from parm_trainer.models.init import init_weights_layout_free
from parm_trainer.parallel import initialize_distributed
from parm_trainer.training import setup

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--num-experts", "2",
         "--moe-ffn-hidden-size", "64", "--disable-bias-linear", "--moe-parm-schedule", "s1",
         "--moe-parm-chunks", "1", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--micro-batch-size", "2", "--global-batch-size", "12", "--seed", "5",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
# (vocabulary, overlap, distributed optimizer, MTP layers): 512 words reduce the kept rows
# sparsely, 8 densely (each rank keeps about as many rows as its shard has); with an MTP layer
# (rope) its embedding lookup's rows go to the sink too, and its MoE block paces one piece more
CASES = [(512, True, False, 0), (8, True, False, 0), (512, False, False, 0),
         (512, True, True, 0), (512, True, False, 1)]
MTP = ["--position-embedding-type", "rope", "--mtp-num-layers"]
MICRO = 3


def build(args, vocab, ours):
    config = transformer_config(args)
    if ours:
        return setup.build_model(args, config, lambda a, c, pre, post: build_gpt_moe(
            a, c, vocab, pre, post))[0]
    module = build_gpt_moe(args, config, vocab)
    init_weights_layout_free(module, args.seed, args.init_method_std, args.num_layers)
    setup.mark_expert_params(module)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap_grad_reduce,
        bucket_size=args.ddp_bucket_size, use_distributed_optimizer=args.use_distributed_optimizer)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    model.broadcast_params()
    return model


def step(model, vocab, seed):
    """Three micro-batches (the first two under no_sync), then DDP's finish_grad_sync;
    early: whether the embedding's reduction was launched when the backward of the last
    micro-batch reached the transformer layers."""
    model.zero_grad_buffer()
    weight = model.module.embedding.word_embeddings.weight
    seen = []

    def state():  # the embedding's reduction launched? (paced: and its pieces launched)
        launched = model.param_to_bucket_group[weight].grad_reduce_handle is not None
        paced = getattr(model, "paced_embedding", None)
        return (launched, paced.launched) if paced is not None else launched

    hook = model.module.decoder.register_full_backward_pre_hook(
        lambda module, grad: seen.append(state()))
    generator = torch.Generator().manual_seed(seed * 100 + dist.get_rank() // 2)  # per DP rank
    for micro in range(MICRO):
        tokens = torch.randint(0, vocab, (2, 16), generator=generator)
        labels = torch.randint(0, vocab, (2, 16), generator=generator)
        positions = torch.arange(16).expand(2, 16)
        sync = contextlib.nullcontext() if micro == MICRO - 1 else model.no_sync()
        with sync:
            loss = model(tokens, positions, None, labels=labels).float().mean()
            loss.backward()
    hook.remove()
    at_end = state()
    model.finish_grad_sync(force_all_reduce=model.force_all_reduce)
    return seen[-1], at_end


HANG_S = 100


def main(report):
    cpu.apply()
    for vocab, overlap, distopt, mtp in CASES:
        flags = FLAGS + ["--overlap-grad-reduce"] * overlap + \
            ["--use-distributed-optimizer"] * distopt + (MTP + [str(mtp)] if mtp else [])
        args = parse_args(flags, world_size=4)
        if report["checks"] == 0:
            initialize_distributed(args)
            model_parallel_cuda_manual_seed(args.seed)
        moe_utils.get_moe_layer_wise_logging_tracker().clear()  # sized by the MoE+MTP layers
        ours, theirs = build(args, vocab, True), build(args, vocab, False)
        theirs.force_all_reduce = distopt  # the reference's gradients whole on every rank
        case = f"vocab {vocab} overlap {overlap} distopt {distopt} mtp {mtp}"
        assert (getattr(ours.module, "mtp", None) is not None) == bool(mtp), case
        assert ours.tied_embedding is not None, case
        weight = ours.module.embedding.word_embeddings.weight
        buckets = ours.param_to_bucket_group[weight].buckets
        if overlap:  # the weight alone in its bucket, and megatron's layout does not give that
            assert [b.params for b in buckets] == [{weight}], case
        for seed in (1, 2):
            early = step(ours, vocab, seed), step(theirs, vocab, seed)
            if overlap and seed == 2:  # (megatron launches nothing early in its first step)
                # (when the layers' backward starts, at its end): megatron's launches at the
                # end, ours before the layers; paced (without the distributed optimizer), its
                # pieces none yet (the MTP layers' MoE blocks' ones), then one per MoE layer
                want = ((True, mtp), (True, 2 + mtp)) if not distopt else (True, True)
                assert early == (want, (False, True)), (case, early)
            assert (ours.paced_embedding is not None) == (overlap and not distopt), case
            mine = dict(ours.module.named_parameters())
            for name, param in theirs.module.named_parameters():
                if distopt:  # ours reduce-scattered: only this rank's shard is reduced
                    break
                got, want = mine[name].main_grad, param.main_grad
                err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
                assert err < 1e-5, (case, seed, name, err)
                report["checks"] += 1
            if distopt:  # compare the owned shard of the embedding's bucket
                group = ours.param_to_bucket_group[weight]
                ours_bucket = group.buckets[0]
                rank = group.intra_distributed_optimizer_instance_rank
                ranks = group.intra_distributed_optimizer_instance_size
                shard = ours_bucket.grad_data.numel() // ranks
                got = ours_bucket.grad_data[rank * shard:(rank + 1) * shard]
                full = theirs.module.embedding.word_embeddings.weight.main_grad.reshape(-1)
                want = full.new_zeros(ours_bucket.grad_data.numel())
                want[:full.numel()] = full
                want = want[rank * shard:(rank + 1) * shard]
                err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
                assert err < 1e-5, (case, seed, "embedding shard", err)
                report["checks"] += 1
        path = ours.tied_embedding.last_path
        assert path == ("dense" if vocab == 8 else "sparse"), (case, path)


if __name__ == "__main__":
    import os.path
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: rank_main
    import rank_main

    rank_main.run(main, HANG_S)
