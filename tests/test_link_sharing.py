"""Shared links and cores in the cost models (parm_trainer/moe/link_sharing.py): the flows a
layout's groups put on a node's link, the link sharing Profile.rate prices from them, the
compute rate with fewer ranks computing at once, what calibrate_comm records for both, and
how the planner uses them (tied-embedding all-reduce, P2P per stage boundary, pipeline steps).

    .venv/bin/python -m pytest tests/test_link_sharing.py -q
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from parm_trainer.errors import ProfileError
from parm_trainer.moe.cost_profile import KINDS, Profile
from parm_trainer.moe.cost_shape import remote_share
from parm_trainer.moe.link_sharing import (concurrency_factor, link_flows, links_from,
                                           remote_share_of, sharing, tiled_groups)


def _profile(**extra) -> Profile:
    """2 ranks per node; inter rings 1e-8 s/byte, intra 1e-10, no latencies."""
    colls = {k: {"intra": {"alpha": 0.0, "beta": 1e-10}, "inter": {"alpha": 0.0, "beta": 1e-8}}
             for k in KINDS}
    return Profile.from_json(json.dumps({"gpus_per_node": 2, "collectives": colls,
                                         "compute": {"alpha": 0.0, "beta": 1e-12}, **extra}))


def test_flows_of_groups_on_a_node_link():
    # 2 nodes x 2 ranks: the world ring 0-1-2-3 leaves each node once; the DP pairs of
    # TP 2 ({0, 2} and {1, 3}) leave each node twice; pairs inside a node never
    assert link_flows([[0, 1, 2, 3]], 2) == 1
    assert tiled_groups(2, 2, 2) == [[0, 2], [1, 3]]
    assert link_flows(tiled_groups(2, 2, 2), 2) == 2
    assert link_flows(tiled_groups(2, 1, 2), 2) == 0
    # 2 x 4, the world ring: once per node; a rank per node for each of 4 positions: 4 times
    assert link_flows([list(range(8))], 4) == 1
    assert link_flows(tiled_groups(2, 4, 4), 4) == 4
    # the same placement rule as remote_share, on any group list
    for size, stride, per_node in ((4, 1, 2), (2, 2, 2), (3, 1, 8), (4, 8, 8), (8, 1, 4)):
        assert remote_share(size, stride, per_node) == \
            remote_share_of(tiled_groups(size, stride, per_node), per_node)


def test_rate_scales_ring_collectives_by_their_flows_over_the_calibrations():
    one_link = _profile(node_links=1)
    # the world ring as calibrated (1 flow); the DP pairs put 2 flows on one link: twice
    assert one_link.rate("allreduce", 4, 1) == (0.0, pytest.approx(1e-8))
    assert one_link.rate("allreduce", 2, 2) == (0.0, pytest.approx(2e-8))
    assert one_link.rate("allgather", 2, groups=[[0, 2]]) == (0.0, pytest.approx(1e-8))
    # inside a node, and AlltoAll (priced per byte that crosses), as before
    assert one_link.rate("allreduce", 2, 1) == (0.0, 1e-10)
    assert one_link.rate("alltoall", 2, 2) == (0.0, pytest.approx(1e-8))
    # a NIC per rank (no node_links: the default) shares nothing
    assert _profile().rate("allreduce", 2, 2) == (0.0, pytest.approx(1e-8))
    # calibrated with --group-size 2 across nodes (2 flows per link): the world ring is
    # priced at half the calibrated time per byte
    grouped = _profile(node_links=1, inter_flows=2)
    assert grouped.rate("allreduce", 4, 1)[1] == pytest.approx(0.5e-8)
    assert grouped.rate("allreduce", 2, 2)[1] == pytest.approx(1e-8)
    assert sharing(4, 2.0) == 2.0 and sharing(1, 2.0) == 1.0


def test_links_and_concurrency_from_measurements():
    assert links_from(1, 1e-8, 2, 2e-8) == pytest.approx(1.0)   # one shared link
    assert links_from(1, 1e-8, 2, 1e-8) == pytest.approx(2.0)   # a link per rank
    assert links_from(1, 1e-8, 4, 2e-8) == pytest.approx(2.0)
    assert links_from(1, 1e-8, 2, 0.9e-8) == 2.0                # faster: clamped to the flows
    points = ((1, 0.5), (2, 0.5), (4, 1.0))
    assert concurrency_factor(points, 3) == pytest.approx(0.75)
    assert concurrency_factor(points, 0.5) == 0.5 and concurrency_factor(points, 8) == 1.0
    assert concurrency_factor((), 3) == 1.0
    profile = _profile(compute_concurrency=[[1, 0.5], [4, 1.0]])
    assert profile.concurrency(2.5) == pytest.approx(0.75)
    scaled = profile.scaled_compute(0.5)
    assert scaled.compute == (0.0, 0.5e-12) and profile.compute == (0.0, 1e-12)
    again = Profile.from_json(profile.to_json())
    assert again.compute_concurrency == ((1, 0.5), (4, 1.0))
    assert Profile.from_json(_profile(node_links=1.5, inter_flows=2).to_json()).node_links == 1.5


@pytest.mark.parametrize("entry, message", [
    ({"node_links": 0.5}, "node_links must be a number >= 1"),
    ({"node_links": True}, "node_links must be a number >= 1"),
    ({"inter_flows": 0}, "inter_flows must be a positive integer"),
    ({"compute_concurrency": [[0, 1.0]]}, "compute_concurrency needs ranks >= 1"),
    ({"compute_concurrency": [[1, -1.0]]}, "compute_concurrency needs ranks >= 1"),
    ({"compute_concurrency": 3}, "compute_concurrency must be"),
])
def test_bad_sharing_entries_are_refused(entry, message):
    with pytest.raises(ProfileError, match=message):
        _profile(**entry)


def test_report_records_links_flows_and_concurrency(tmp_path):
    """Synthetic measurements, exact lines: the AllReduce with 2 flows per node takes twice
    the 1-flow time per byte, so the node has 1 link; the world ring had 1 flow."""
    from parm_trainer.bench.calibration.report import report
    sizes = [2 ** 18 * 2 ** i for i in range(4)]
    line = lambda alpha, beta: [(b, alpha + b * beta) for b in sizes]  # noqa: E731
    measured = {link: (4, {kind: line(1e-4, 1e-8 if link == "inter" else 1e-9)
                           for kind in KINDS}) for link in ("intra", "inter")}
    local = {"compute": line(1e-5, 1e-11), "memory": line(1e-6, 1e-10),
             "concurrency": [(1, 0.5), (2, 0.5), (4, 1.0)],
             "link_sharing": (1, [(1, line(1e-4, 1e-8)), (2, line(1e-4, 2e-8))]),
             "sync_wait": [(0.003, 0.0), (0.006, 0.004), (0.03, 0.0015)]}
    args = argparse.Namespace(sizes=sizes, repeats=3, warmup=1, name="t", require_r2=False,
                              output=str(tmp_path / "p.json"))
    assert report(args, "gloo", 4, 2, 2, measured, local, {"intra": 0.0, "inter": 1.0},
                  {"intra": 0.0, "inter": 2 / 3}) == 0
    profile = Profile.from_json(str(tmp_path / "p.json"))
    assert profile.node_links == pytest.approx(1.0) and profile.inter_flows == 1
    assert profile.compute_concurrency == ((1, 0.5), (2, 0.5), (4, 1.0))
    assert profile.rate("allreduce", 2, 2)[1] == pytest.approx(2e-8, rel=1e-6)
    assert profile.layer == (1.0, 1.0, 0.0, pytest.approx(0.0015))  # the median wait


def _demo_args(pp, extra=()):
    from parm_trainer.arguments import parse_args

    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--num-experts", "4", "--moe-router-topk", "2",
            "--lr", "1e-3", "--pipeline-model-parallel-size", str(pp), *extra]
    args = parse_args(argv, world_size=4)
    args.padded_vocab_size = 1024
    return args


def test_planner_prices_the_embedding_all_reduce_and_each_boundary():
    from parm_trainer.planning.model_cost import ModelCost
    from parm_trainer.planning.stages import even_split, predict

    profile = _profile(node_links=1)
    cost = ModelCost(_demo_args(2), profile)
    # PP 2 on 2 x 2: stage 0 on node 0, stage 1 on node 1; both embedding pairs cross at once
    assert cost.stage_pairs(0, 1) == [[0, 2], [1, 3]]
    assert cost.embedding_sync_s() == pytest.approx(
        2 * 1024 * 64 * 4 / 2 * 2e-8)  # AllReduce of 2: B sent, at 2 flows on one link
    tied = predict(even_split(cost.pieces(), 2), cost, 2, 1, 2)
    untied = predict(even_split(cost.pieces(), 2), cost, 2, 1, 2, tied=False)
    first = tied["ranks"][0]
    assert first["sync_s"] == pytest.approx(
        cost.gradient_sync_s(first["params"], first["expert_params"]) + cost.embedding_sync_s())
    assert untied["iteration_s"] < tied["iteration_s"]
    # PP 4 on 2 x 2: only the boundary between pipeline ranks 1 and 2 leaves a node
    four = ModelCost(_demo_args(4), profile)
    assert four.p2p_s(0, 1) < four.p2p_s(1, 2)
    assert four.p2p_s(1, 2) == pytest.approx(
        profile.rate("allgather", 2, groups=[[1, 2]])[0] + 32 * 2 * 64 * 4 * 1e-8)  # fp32, 1 flow
    assert ModelCost(_demo_args(1), profile).embedding_sync_s() == 0.0


def test_p2p_across_nodes_gets_the_links_burst():
    """A node link that passes burst_bytes at once after a pause (calibrate_comm's
    measure_burst): a P2P transfer across nodes pays only the bytes beyond its share of the
    burst (the pairs leaving a node at once split it), never below the call's alpha; inside a
    node nothing changes."""
    from dataclasses import replace

    from parm_trainer.planning.model_cost import ModelCost

    profile = _profile(node_links=1)
    four, two = ModelCost(_demo_args(4), profile), ModelCost(_demo_args(2), profile)
    alpha = profile.rate("allgather", 2, groups=[[1, 2]])[0]
    nbytes = 32 * 2 * 64 * 4  # one fp32 activation per pair
    burst = replace(profile, burst_bytes=nbytes / 4)
    bursty4, bursty2 = ModelCost(_demo_args(4), burst), ModelCost(_demo_args(2), burst)
    # PP 4: one pair crosses between pipeline ranks 1 and 2, the whole burst its own
    assert bursty4.p2p_s(1, 2) == pytest.approx(alpha + nbytes * 3 / 4 * 1e-8)
    assert bursty4.p2p_s(0, 1) == pytest.approx(four.p2p_s(0, 1))  # inside node 0
    # PP 2: both pairs of the stages leave their node at once (2 flows: 2e-8 per byte each)
    both = two.profile.rate("allgather", 2, groups=two.stage_pairs(0, 1))
    assert both[1] == pytest.approx(2e-8)
    assert bursty2.p2p_s(0, 1) == pytest.approx(both[0] + (nbytes - nbytes / 8) * 2e-8)
    flood = ModelCost(_demo_args(4), replace(profile, burst_bytes=10 * nbytes))
    assert flood.p2p_s(1, 2) == pytest.approx(alpha)


def test_every_collective_pays_the_calibrated_wait_at_a_call():
    """s_per_call (what calibrate_comm measures as the wait at a collective after compute) is
    added once per collective call of the dense pieces, as plan_cost adds it per call of the
    MoE layer's steps; a group of one makes no call, and P2P none (its wait is the
    schedule's)."""
    from dataclasses import replace

    from parm_trainer.planning.model_cost import ModelCost

    profile = _profile(node_links=1)
    waiting = replace(profile, layer=(1.0, 1.0, 0.0, 0.002))
    args = _demo_args(2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    plain, paid = ModelCost(args, profile), ModelCost(args, waiting)
    assert paid.coll("allgather", 4096, 2) == pytest.approx(plain.coll("allgather", 4096, 2)
                                                            + 0.002)
    assert paid.coll("allreduce", 4096, 1) == 0.0
    # a P2P transfer's wait is the other stage's: the pipeline steps price it
    assert paid.p2p_s(0, 1) == pytest.approx(plain.p2p_s(0, 1))
    # a dense attention block under SP: an AllGather in and a ReduceScatter out, each way
    forward, backward, _ = paid.attention()
    assert forward - plain.attention()[0] == pytest.approx(2 * 0.002)
    assert backward - plain.attention()[1] == pytest.approx(2 * 0.002)


def test_pipeline_steps_price_warm_up_at_the_ranks_computing():
    """1F1B's time: (m - 1) x the slowest rank plus one pass through every rank. With no
    links priced (all compute, every time linear in the compute factor), interleaved 1F1B on
    shared cores prices a rank's forward in the warm-up with a of P ranks working at the factor
    of a x (ranks per stage) ranks computing at once; plain 1F1B on shared cores is played out
    task by task (pipeline_sim.py), from each rank's compute."""
    from parm_trainer.planning.model_cost import ModelCost
    from parm_trainer.planning.pipeline_sim import one_f_one_b
    from parm_trainer.planning.stages import predict, split

    zero = {k: {"intra": (0.0, 0.0), "inter": (0.0, 0.0)} for k in KINDS}
    flat = Profile(gpus_per_node=2, collectives=zero, compute=(0.0, 1e-12))
    curve = Profile(gpus_per_node=2, collectives=zero, compute=(0.0, 1e-12),
                    compute_concurrency=((2, 0.5), (4, 1.0)))
    args = _demo_args(2)
    cost = ModelCost(args, flat)
    runs = split(cost.pieces(), 2, cost)
    base = predict(runs, cost, 2, 1, 4)
    ranks = base["ranks"]
    slowest = max(r["time_s"] for r in ranks)
    assert sum(base["steps_s"]) == pytest.approx(3 * slowest + sum(r["time_s"] for r in ranks))
    assert ranks[0]["forward_s"] + ranks[0]["backward_s"] == pytest.approx(ranks[0]["time_s"])
    played = predict(runs, ModelCost(args, curve), 2, 1, 4)["steps_s"]
    work = [{"F": r["forward_s"], "B": r["backward_s"]} for r in ranks]
    idle = [{"F": 0.0, "B": 0.0}] * 2
    assert played == [pytest.approx(one_f_one_b(work, idle, 2, 4, 2, curve.concurrency), rel=1e-3)]
    # alone, a stage's 2 ranks compute at 0.5 x the time of all 4 at once: faster than flat
    assert played[0] < sum(base["steps_s"])

    chunks = split(cost.pieces(), 4, cost)  # 2 virtual stages per rank: played out too
    ranks = predict(chunks, cost, 2, 2, 4)["ranks"]
    shared = predict(chunks, ModelCost(args, curve), 2, 2, 4)["steps_s"]
    stages = [ranks[s % 2]["chunks"][s // 2] for s in range(4)]  # stage s: chunk s // P
    work = [{"F": c["forward_s"], "B": c["backward_s"]} for c in stages]
    assert sum(c["forward_s"] for c in ranks[1]["chunks"]) == pytest.approx(ranks[1]["forward_s"])
    assert shared == [pytest.approx(one_f_one_b(work, idle * 2, 2, 4, 2, curve.concurrency, 2),
                                    rel=1e-3)]
    assert shared[0] < sum(predict(chunks, cost, 2, 2, 4)["steps_s"])


def test_a_stages_ranks_compute_in_lock_step():
    """A stage's ranks compute at once (the same work between the same collectives): however
    long they wait on links, their compute is priced at the factor of all of them; only other
    stages' ranks count by the share of their time they compute. PP 1 on 4 ranks over 2 x 2
    with links priced: the same compute as at the calibrated rate of all 4 at once."""
    from parm_trainer.planning.model_cost import ModelCost
    from parm_trainer.planning.pipeline_sim import one_f_one_b
    from parm_trainer.planning.stages import predict, split

    linked = _profile(node_links=1)
    curve = replace(linked, compute_concurrency=((1, 0.25), (2, 0.5), (4, 1.0)))
    args = _demo_args(1, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    runs = split(ModelCost(args, linked).pieces(), 1, ModelCost(args, linked))
    flat = predict(runs, ModelCost(args, linked), 1, 1, 2)
    shared = predict(runs, ModelCost(args, curve), 1, 1, 2)
    assert shared["steps_s"] == pytest.approx(flat["steps_s"], rel=1e-3)
    # played out, one stage of 2 ranks with half of each task on links: its own 2 ranks
    # compute together (factor 0.5): forward 1 x 0.5 + 1, backward 2 x 0.5 + 1, twice
    shares = lambda k: min(1.0, k / 4)  # noqa: E731
    assert one_f_one_b([{"F": 1.0, "B": 2.0}], [{"F": 1.0, "B": 1.0}], 1, 2, 2,
                       shares) == pytest.approx(2 * (1.5 + 2.0))


def test_one_f_one_b_played_out_by_hand():
    """pipeline_sim against makespans worked out by hand from megatron's 1F1B order."""
    from parm_trainer.planning.pipeline_sim import one_f_one_b, order

    assert order(2, 2) == [[("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)],
                           [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]]
    balanced = [{"F": 1.0, "B": 2.0}] * 3
    none = [{"F": 0.0, "B": 0.0}] * 3
    # one factor for any number computing: (m + P - 1) (f + b), all compute or all links
    assert one_f_one_b(balanced, none, 3, 5, 1, lambda k: 1.0) == pytest.approx(21.0)
    assert one_f_one_b(none, balanced, 3, 5, 1, lambda k: 0.5) == pytest.approx(21.0)
    # 2 stages, 2 micro-batches, factor a alone and c with both computing: rank 0's forward
    # alone (a), both forwards (c), rank 1's backward alone (2a), rank 0's backward beside rank
    # 1's forward (c) and then its backward (c), the rest of rank 1's backward (a), rank 0's
    # last backward (2a): 6a + 3c
    factor = {1: 0.5, 2: 1.0}
    makespan = one_f_one_b(balanced[:2], none[:2], 2, 2, 1, lambda k: factor[round(k)])
    assert makespan == pytest.approx(6 * 0.5 + 3 * 1.0)


def test_interleaved_played_out_by_hand():
    """megatron's interleaved order (get_schedule_table, its warm-up counts) and its makespan
    worked out by hand; balanced, the closed form (m + (P - 1) / V) x a rank's time."""
    from parm_trainer.planning.pipeline_sim import one_f_one_b, order

    # rank 0 warms up (P - 1) x 2 + (V - 1) x P = 4 forwards (all), rank 1 2
    assert order(2, 2, 2) == [
        [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
         ("B", 0, 1), ("B", 1, 1), ("B", 0, 0), ("B", 1, 0)],
        [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 0, 1),
         ("F", 1, 1), ("B", 1, 1), ("B", 0, 0), ("B", 1, 0)]]
    chunk = [{"F": 1.0, "B": 2.0}] * 4
    none = [{"F": 0.0, "B": 0.0}] * 4
    # the 4 stages' forwards of micro-batches 0, 1 end at 4; rank 1's last-stage backward of
    # micro-batch 0 (4-6), its forward of 1 (6-7) and backward (7-9); rank 0's chunk 1
    # backwards (6-8, 9-11), then the chunk 0 backwards on both ranks (to 13 and 15)
    assert one_f_one_b(chunk, none, 2, 2, 1, lambda k: 1.0, vp=2) == pytest.approx(15.0)
    assert one_f_one_b(chunk, none, 2, 4, 1, lambda k: 1.0, vp=2) == pytest.approx((4 + 0.5) * 6)
    # a slower first chunk holds the whole schedule back; a slower last one does too
    slow = [{"F": 2.0, "B": 4.0}, *chunk[1:]]
    assert one_f_one_b(slow, none, 2, 4, 1, lambda k: 1.0, vp=2) > 27.0
    assert one_f_one_b([*chunk[:3], slow[0]], none, 2, 4, 1, lambda k: 1.0, vp=2) > 27.0
    # transfers of 0.5 at every boundary, overlapped (overlap_p2p_comm) only in the steady
    # phase: rank 0 (4 warm-up forwards, no steady phase) and rank 1's 2 warm-up forwards and
    # 2 cool-down backwards block on theirs (0.5 a side, the first and last stage one side);
    # stage 0's forwards 0-1.5, 1.5-3; stage 1's 1.5-3.5, 3.5-5.5; stage 2's 3.5-5.5, 5.5-7.5;
    # rank 1's steady last stage: F 5.5-6.5, B 6.5-8.5, F 8.5-9.5, B 9.5-11.5, each backward
    # reaching stage 2 0.5 later: its backwards 9-12, 12-15; stage 1's 12-15, 15-18; stage 0's
    # 15-17.5, 18-20.5
    assert one_f_one_b(chunk, none, 2, 2, 1, lambda k: 1.0, vp=2,
                       transfer=[0.5] * 4) == pytest.approx(20.5)
    # plain order, one micro-batch: F 0-1.5 (warm-up, blocking), F 1.5-2.5 and B 2.5-4.5
    # (steady), B from 4.5 + 0.5 to 7.5 (cool-down, blocking)
    assert one_f_one_b(chunk[:2], none, 2, 1, 1, lambda k: 1.0,
                       transfer=[0.5] * 2) == pytest.approx(7.5)


def test_interleaved_transfers_overlap_the_compute():
    """megatron's interleaved schedule posts its steady phase's P2P transfers beside the
    compute (overlap_p2p_comm, on by default): cheaper than the same layout with
    --no-overlap-p2p-communication, whose transfers block as plain 1F1B's do; each chunk
    knows its transfer to the next."""
    from parm_trainer.planning.model_cost import ModelCost
    from parm_trainer.planning.stages import predict, split

    linked = _profile(node_links=1)
    for curve in (None, ((2, 0.5), (4, 1.0))):  # the closed form and the played-out schedule
        args = _demo_args(2)
        cost = ModelCost(args, replace(linked, compute_concurrency=curve))
        chunks = split(cost.pieces(), 4, cost)
        overlapped = predict(chunks, cost, 2, 2, 4)
        rank = overlapped["ranks"][0]
        assert rank["chunks"][0]["send_s"] == pytest.approx(cost.p2p_s(0, 1))
        assert cost.p2p_s(0, 1) > 0
        assert rank["p2p_s"] == pytest.approx(2 * sum(c["p2p_s"] for c in rank["chunks"]))
        args.overlap_p2p_comm = False
        blocking = predict(chunks, ModelCost(args, cost.profile), 2, 2, 4)
        assert blocking["iteration_s"] > overlapped["iteration_s"]


def test_wait_at_a_call_scales_with_the_compute_rate():
    """The wait at a collective call is time on a peer still computing: a profile with compute
    `factor` times as long has it `factor` times as long too."""
    profile = _profile(layer={"comm_factor": 1.0, "compute_factor": 1.0, "host_s_per_step": 0.0,
                              "s_per_call": 0.004})
    assert profile.scaled_compute(0.5).layer[3] == pytest.approx(0.002)
    assert profile.scaled_compute(0.5).layer[:3] == profile.layer[:3]


def test_memory_rate_is_fitted_on_relative_errors():
    """A largest size 3 x slower than the line through the others (a cache-missing point on
    shared cores) sets a plain least-squares rate alone; the relative fit stays near the line."""
    from parm_trainer.bench.calibration.fit import fit

    sizes = [2 ** 17 * 4 ** i for i in range(5)]
    points = [(b, 1e-5 + b * 1e-10) for b in sizes]
    points[-1] = (sizes[-1], 3 * points[-1][1])
    plain, relative = fit(points), fit(points, relative=True)
    assert plain[1] > 2.5e-10
    assert relative[1] < 1.5e-10 and not relative[3]
    assert fit([(b, 1e-5 + b * 1e-10) for b in sizes], relative=True)[1] == pytest.approx(1e-10)


def test_calibration_puts_one_and_a_nodes_worth_of_flows_on_each_link():
    """The groups calibrate_comm measures link sharing on: a ring of one rank per node for
    each position (a node's ranks' worth of flows), or only the first position's (1 flow)."""
    from parm_trainer.bench.calibration.waits import flow_groups

    assert flow_groups(4, 2, 2) == [[0, 2], [1, 3]] and link_flows(flow_groups(4, 2, 2), 2) == 2
    assert flow_groups(4, 2, 1) == [[0, 2]] and link_flows(flow_groups(4, 2, 1), 2) == 1
    assert link_flows(flow_groups(8, 4, 4), 4) == 4
    assert link_flows(flow_groups(12, 4, 4), 4) == 4  # rings of 3 nodes: one edge out per rank


def test_planner_prices_gradients_reduced_node_by_node():
    """On gloo, a DP group over 2 nodes of 2 is priced as node_reduce.py runs it: an all-reduce
    inside each node, then one of half the bytes between the nodes (two pairs leave a node at
    once: 2 flows on its link), against the ring's 2 (D-1)/D of the bytes on one flow; with
    --no-grad-reduce-by-node or NCCL, the ring."""
    from parm_trainer.planning.model_cost import ModelCost

    profile, nbytes = _profile(node_links=1), 1e6
    cost = ModelCost(_demo_args(1), profile)
    assert cost.args.distributed_backend == "gloo"
    assert cost.gradient_all_reduce_s(nbytes, 4, 1) == pytest.approx(
        nbytes * 1e-10 + nbytes / 2 * 2e-8)
    ring = nbytes * 2 * 3 / 4 * 1e-8
    assert ModelCost(_demo_args(1, ["--no-grad-reduce-by-node"]), profile) \
        .gradient_all_reduce_s(nbytes, 4, 1) == pytest.approx(ring)
    nccl = ModelCost(_demo_args(1, ["--distributed-backend", "nccl"]), profile)
    assert nccl.gradient_all_reduce_s(nbytes, 4, 1) == pytest.approx(ring)
    # one rank per node in each group (DP pairs across nodes): nothing to sum inside a node
    assert cost.gradient_all_reduce_s(nbytes, 2, 2) == pytest.approx(nbytes * 2e-8)
