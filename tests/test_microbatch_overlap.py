"""--overlap-moe-expert-parallel-comm (training/microbatch_overlap.py, moe/turns.py): micro-batches
in pairs taking turns give megatron-core's schedule's losses and gradients. On 4 gloo ranks (MP2
with SP x EP2 x ESP2, DP2, Parm's s1 exact exchange), with 4 and 3 micro-batches per step, with
and without --overlap-grad-reduce (paced) and under the distributed optimizer: every loss of
forward_backward_overlapped equals forward_backward_no_pipelining's on a twin model (same
weights, same data), every reduced main_grad agrees to 1e-5 (the additions' order differs), in
the first step (DDP learning when each bucket is ready) and the next; and the micro-batches
really took turns: the second of a pair entered its first MoE layer before the first left its
last, on threads of their own."""

from conftest import run_rank_workers



def test_overlapped_microbatches_match_megatrons_schedule(tmp_path):
    reports = run_rank_workers(tmp_path, "worker_microbatch_overlap.py", 4, timeout=300)
    assert len(reports) == 4
    assert len({r["checks"] for r in reports}) == 1 and reports[0]["checks"] > 30, reports
