"""s1's load-balancing loss with its counts in the exact exchange's AllGather (moe/aux_loss.py).

One launch of 4 gloo ranks, three layouts of s1 on the exact exchange (sequence parallel,
top-2, aux coefficient 0.1): MP 2 / EP 2 / ESP 2 and MP 2 / EP 2 / ESP 1, where the EP x ESP
group holds the MP group, and MP 4 / EP 2 / ESP 1, where it does not. On each a layer is run
forward and backward twice on the same weights and data: as built, and with the router's own
path forced (defer off). The built layer must defer exactly where the group holds MP (the
router's MP count all-reduce, megatron-core's get_tokens_per_expert_and_token_count, not
called in its forward), and both runs must give the same output, tracked aux loss, input
gradient and router and expert gradients (1e-6 relative): the router's own computation is the
reference. (tests/test_moe_layer.py checks every layout's aux loss and gate gradient against
the single-process reference as well.)

    .venv/bin/python -m pytest tests/test_aux_loss.py -q
"""

from conftest import run_rank_workers



def test_s1_aux_loss_rides_in_the_count_gather(tmp_path):
    reports = run_rank_workers(tmp_path, "worker_aux_loss.py", 4, timeout=240)
    assert len(reports) == 4
    assert len({r["checks"] for r in reports}) == 1 and reports[0]["checks"] >= 15, reports
