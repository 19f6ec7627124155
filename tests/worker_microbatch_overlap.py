"""The ranks' side of tests/test_microbatch_overlap.py (run by conftest.run_rank_workers)."""
import threading
import torch
import torch.distributed as dist
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from parm_trainer.arguments import parse_args
from parm_trainer.compat import cpu
from parm_trainer.models.config import transformer_config
from parm_trainer.models.gpt import build_gpt_moe
from parm_trainer.parallel import initialize_distributed
from parm_trainer.training import microbatch_overlap, setup
from parm_trainer.training.paced_reduction import moe_blocks

VOCAB, SEQ, MBS = 64, 16, 2
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--num-experts", "4",
         "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64", "--disable-bias-linear",
         "--moe-parm-schedule", "s1", "--moe-parm-chunks", "1",
         "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--expert-model-parallel-size", "2", "--micro-batch-size", str(MBS), "--seed", "5",
         "--hidden-dropout", "0", "--attention-dropout", "0",
         "--overlap-moe-expert-parallel-comm"]
# (micro-batches, --overlap-grad-reduce, distributed optimizer)
CASES = [(4, True, False), (3, False, False), (4, True, True)]


def build(args):
    config = transformer_config(args)
    (model,) = setup.build_model(args, config, lambda a, c, pre, post: build_gpt_moe(
        a, c, VOCAB, pre, post))
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    return model


def batches(count, seed):
    generator = torch.Generator().manual_seed(seed * 100 + dist.get_rank() // 2)  # per DP rank
    return [dict(tokens=torch.randint(0, VOCAB, (MBS, SEQ), generator=generator),
                 labels=torch.randint(0, VOCAB, (MBS, SEQ), generator=generator),
                 mask=(torch.rand(MBS, SEQ, generator=generator) > 0.1).float())
            for _ in range(count)]


def forward_step(iterator, model):
    batch = next(iterator)
    positions = torch.arange(SEQ).expand(MBS, SEQ)
    output = model(batch["tokens"], positions, None, labels=batch["labels"])

    def loss(output):
        total = (output.float().view(-1) * batch["mask"].view(-1)).sum()
        count = batch["mask"].sum()
        return total, count.to(torch.int), {"lm loss": torch.stack([total.detach(), count])}
    return output, loss


def step(model, schedule, count, seed, entered):
    model.zero_grad_buffer()
    del entered[:]
    store = schedule(forward_step_func=forward_step, data_iterator=iter(batches(count, seed)),
                     model=[model], num_microbatches=count, seq_length=SEQ,
                     micro_batch_size=MBS, forward_only=False)
    losses = [item["lm loss"].tolist() for item in store]
    grads = {name: p.main_grad.clone() for name, p in model.module.named_parameters()}
    if model.ddp_config.use_distributed_optimizer:  # only this rank's shard is reduced: compare
        groups = model.bucket_groups + model.expert_parallel_bucket_groups
        grads = {f"bucket{i}": b.grad_data.clone()  # the owned shard of each bucket
                 for i, g in enumerate(groups) for b in g.buckets}
        for key, group in zip(list(grads), groups):
            shards = group.intra_distributed_optimizer_instance_size
            rank = group.intra_distributed_optimizer_instance_rank
            grads[key] = grads[key].view(shards, -1)[rank]
    return losses, grads


HANG_S = 150


def main(report):
    cpu.apply()
    for count, overlap, distopt in CASES:
        flags = FLAGS + ["--global-batch-size", str(count * MBS * 2)] + \
            ["--overlap-grad-reduce"] * overlap + ["--use-distributed-optimizer"] * distopt
        args = parse_args(flags, world_size=4)
        if report["checks"] == 0:
            initialize_distributed(args)
            model_parallel_cuda_manual_seed(args.seed)
        args.num_microbatches = count  # (the trainer's validation sets it)
        assert microbatch_overlap.usable(args, forward_only=False)
        case = f"micro-batches {count} overlap-grad-reduce {overlap} distopt {distopt}"
        ours, theirs = build(args), build(args)
        for a, b in zip(ours.module.parameters(), theirs.module.parameters()):
            assert torch.equal(a, b), case  # twins
        entered = []  # (thread, MoE layer) at each MoE block's forward, in order
        for i, block in enumerate(moe_blocks(ours.module)):
            block.register_forward_pre_hook(
                lambda module, inputs, i=i: entered.append((threading.current_thread().name, i)))
        for seed in (1, 2):
            got = step(ours, microbatch_overlap.forward_backward_overlapped, count, seed,
                       entered)
            want = step(theirs, forward_backward_no_pipelining, count, seed, [])
            assert got[0] == want[0], (case, seed, got[0], want[0])  # the same forward
            for name, grad in want[1].items():
                err = (got[1][name] - grad).abs().max().item() / max(grad.abs().max().item(),
                                                                     1e-12)
                assert err < 1e-5, (case, seed, name, err)
                report["checks"] += 1
            # the first pair: two threads, the second in its first MoE layer before the first
            # left its last (two layers: entries 0 and 1 are each one's layer 0)
            threads = [thread for thread, _ in entered[:4]]
            assert "MainThread" not in threads and entered[0][1] == entered[1][1] == 0 and \
                threads[0] != threads[1], (case, entered[:6])
            report["checks"] += 1


if __name__ == "__main__":
    import os.path
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: rank_main
    import rank_main

    rank_main.run(main, HANG_S)
