"""The ranks' side of tests/test_node_reduce.py (run by conftest.run_rank_workers): 4 ranks,
--ranks-per-node 2, data parallelism 4 (two nodes of two)."""
import contextlib
import os.path
import sys

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core import parallel_state
from parm_trainer import node_reduce
from parm_trainer.arguments import parse_args
from parm_trainer.compat import cpu
from parm_trainer.parallel import initialize_distributed
from parm_trainer.training.node_buckets import ByNode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: the workers, rank_main
from worker_tied_embedding import build  # noqa: E402

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--num-experts", "4",
         "--moe-ffn-hidden-size", "64", "--disable-bias-linear", "--moe-router-topk", "2",
         "--moe-parm-schedule", "s1", "--moe-parm-chunks", "1",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--seed", "5",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--ranks-per-node", "2"]
VOCAB = 512
HANG_S = 100


def relative(got, want) -> float:
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-12)


def sums(report):
    """The node-by-node sum of tensors of every size (fewer elements than ranks on a node
    included), synchronous and several asynchronous at once, is the flat ring's."""
    reduce = node_reduce.reducer(parallel_state.get_data_parallel_group())
    assert reduce is not None and reduce.per_node == 2, reduce
    assert reduce.position == dist.get_rank() % 2, reduce
    generator = torch.Generator().manual_seed(dist.get_rank())
    tensors = [torch.randn(n, generator=generator) for n in (1, 7, 1001, 40_000)]
    flat = [t.clone() for t in tensors]
    for t in flat:
        dist.all_reduce(t)
    mine = [t.clone() for t in tensors]
    reduce.all_reduce(mine[0])
    handles = [reduce.all_reduce(t, async_op=True) for t in mine[1:]]
    for handle in handles:
        handle.wait()
    for got, want in zip(mine, flat):
        assert relative(got, want) < 1e-6, (got.numel(), relative(got, want))
        report["checks"] += 1


def step(model, seed):
    model.zero_grad_buffer()
    generator = torch.Generator().manual_seed(seed * 100 + dist.get_rank())  # per DP rank
    for micro in range(2):
        tokens = torch.randint(0, VOCAB, (2, 16), generator=generator)
        labels = torch.randint(0, VOCAB, (2, 16), generator=generator)
        positions = torch.arange(16).expand(2, 16)
        with contextlib.nullcontext() if micro == 1 else model.no_sync():
            model(tokens, positions, None, labels=labels).float().mean().backward()
    model.finish_grad_sync()


def main(report):
    cpu.apply()
    for overlap in (False, True):
        args = parse_args(FLAGS + ["--overlap-grad-reduce"] * overlap, world_size=4)
        if report["checks"] == 0:
            initialize_distributed(args)
            model_parallel_cuda_manual_seed(args.seed)
            sums(report)
        ours, theirs = build(args, VOCAB, True), build(args, VOCAB, False)
        taken = [g for g in ours.bucket_groups + ours.expert_parallel_bucket_groups
                 if isinstance(getattr(g.start_grad_sync, "__self__", None), ByNode)]
        paced = ours.paced_embedding
        # dense and expert buckets by node, the tied embedding's paced pieces too
        assert len(taken) == len(ours.bucket_groups + ours.expert_parallel_bucket_groups) - \
            (paced is not None), (overlap, len(taken))
        assert (paced is not None) == overlap and (not overlap or paced.by_node is not None)
        for seed in (1, 2):
            step(ours, seed), step(theirs, seed)
            mine = dict(ours.module.named_parameters())
            for name, param in theirs.module.named_parameters():
                err = relative(mine[name].main_grad, param.main_grad)
                assert err < 1e-5, (overlap, seed, name, err)
                report["checks"] += 1
    args = parse_args(FLAGS + ["--no-grad-reduce-by-node"], world_size=4)
    node_reduce.build(args)
    assert node_reduce.reducer(parallel_state.get_data_parallel_group()) is None


if __name__ == "__main__":
    import rank_main

    rank_main.run(main, HANG_S)
