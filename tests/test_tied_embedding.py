"""The tied word embedding's gradient reduced apart (training/tied_embedding.py) is megatron-core's
own: on 4 gloo ranks (TP2 with SP x DP2), three micro-batches per step, two steps, every
parameter's reduced main_grad of the project's DDP equals that of megatron-core's plain
DistributedDataParallel around the same weights and inputs; and with --overlap-grad-reduce the
embedding's reduction is under way before the backward enters the transformer layers (with
megatron's DDP it is not), in a bucket of its own, under both optimizers' bucketing; without
the distributed optimizer it is all-reduced in one piece per MoE layer, each launched as the
backward leaves that layer's MoE block (training/paced_reduction.py); with a multi-token
prediction layer (--mtp-num-layers 1) its lookup of the tied embedding goes through the sink too."""

from conftest import run_rank_workers



def test_tied_embedding_grads_are_megatrons_and_reduced_early(tmp_path):
    reports = run_rank_workers(tmp_path, "worker_tied_embedding.py", 4, timeout=240)
    assert len(reports) == 4
    assert len({r["checks"] for r in reports}) == 1 and reports[0]["checks"] > 20, reports
