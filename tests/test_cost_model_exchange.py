"""The cost model's exact exchange: rows per destination against drawn routings, its bytes
per collective, the relay through nodes, and the GEMM calls each piece pays for
(parm_trainer/moe/cost_model.py; the executor's own bytes are checked in test_moe_layer)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from parm_trainer.moe.cost_model import plan_cost
from parm_trainer.moe.cost_shape import LayerShape
from parm_trainer.moe.schedules import build_plan
from test_cost_model import SHAPE, profile, step_bytes


def test_every_expert_gemm_pays_the_compute_alpha():
    """The exchange's expert runs 2 GEMMs per local expert in each piece: with links free and
    a GEMM alpha of 1 ms, r pieces cost r x 2 L alphas forward and twice that backward, so
    on a small layer a deeper pipeline is priced slower (a per-piece alpha would miss it)."""
    shape = replace(SHAPE, capacity_factor=None, exact=True, experts=8)  # L = 4 per EP rank
    prof = profile(intra_beta=1e-15, inter_beta=1e-15, compute=(1e-3, 1e-18))
    assert shape.expert_gemms() == 8

    def exchange_s(r):
        cost = plan_cost(build_plan("s1", False), replace(shape, chunks=r), prof)
        row, = [row for row in cost["steps"] if row["step"].startswith("exchange")]
        return row["forward_s"], row["backward_s"]

    for r in (1, 2, 4):
        fwd, bwd = exchange_s(r)
        assert fwd == pytest.approx(r * 8e-3, rel=1e-3)
        assert bwd == pytest.approx(2 * r * 8e-3, rel=1e-3)


@pytest.mark.parametrize("experts,topk,ep", [(4, 2, 2), (8, 3, 4), (16, 4, 4), (8, 1, 8)])
def test_exact_exchange_rows_match_random_routing(experts, topk, ep):
    """ep_hit, the chance a token needs a given EP rank, against uniformly drawn top-k sets."""
    rng = np.random.default_rng(0)
    draws = np.argsort(rng.random((20000, experts)), axis=1)[:, :topk]
    hit = np.isin(draws, np.arange(experts // ep)).any(axis=1).mean()
    shape = LayerShape(tokens=64, hidden=8, ffn=8, experts=experts, topk=topk,
                       capacity_factor=None, ep=ep, exact=True)
    assert shape.ep_hit() == pytest.approx(hit, abs=0.01)


def test_relayed_exchange_rows_and_bytes():
    """Relayed over 2 nodes of 2 EP ranks (E 8, top-3, EP 4): node_hit against drawn top-k
    sets; over the link ("ep_link", one peer) each token once per remote node, M + R L wide,
    M back; inside the node ("ep_node", one peer) each rank's rows, M + L wide, M back;
    fewer link bytes than the one hop, whose AlltoAll has 2 of its 3 peers remote."""
    rng = np.random.default_rng(1)
    draws = np.argsort(rng.random((20000, 8)), axis=1)[:, :3]
    one_hop = LayerShape(tokens=256, hidden=64, ffn=64, experts=8, topk=3,
                         capacity_factor=None, ep=4, exact=True, bytes_per_element=4)
    relayed = replace(one_hop, relay=2)
    assert relayed.node_hit() == pytest.approx(np.isin(draws, np.arange(4)).any(axis=1).mean(),
                                               abs=0.01)
    assert relayed.node_hit() < 2 * relayed.ep_hit()
    m, per_rank, per_node = 64, 256 * one_hop.ep_hit(), 256 * relayed.node_hit()
    fwd, bwd = {s: (f, b) for s, f, b in step_bytes("s1", relayed)}["exchange[ep,esp]"]
    assert fwd["alltoall/ep_link"] == pytest.approx(per_node * (m + 4) * 4 + per_node * m * 4,
                                                    abs=2)
    # the relay forwards to its node's other rank that rank's rows from both senders at its
    # position (itself and its peer on the other node)
    assert fwd["alltoall/ep_node"] == pytest.approx(2 * per_rank * (m + 2) * 4
                                                    + 2 * per_rank * m * 4, abs=2)
    assert bwd == fwd and "alltoall/ep" not in fwd
    direct, _ = {s: (f, b) for s, f, b in step_bytes("s1", one_hop)}["exchange[ep,esp]"]
    link_share = 2 / 3  # of the one hop's AlltoAll bytes, those to the other node's 2 ranks
    assert fwd["alltoall/ep_link"] < link_share * direct["alltoall/ep"]


def test_relay_applies_where_an_ep_group_has_ranks_on_several_nodes(monkeypatch):
    """node_relay.relay_size: R for EP groups with R >= 2 ranks on each of >= 2 nodes, top-k
    >= 2 and the exact exchange; 1 (one hop) otherwise; auto's layer shape carries it, from
    --ranks-per-node or else LOCAL_WORLD_SIZE."""
    from types import SimpleNamespace

    from parm_trainer.moe.cost_shape import layer_shape
    from parm_trainer.node_relay import ep_groups, ranks_per_node, relay_size

    def args(world, ep, esp, topk=2, exchange="exact", **extra):
        return SimpleNamespace(world_size=world, expert_model_parallel_size=ep,
                               expert_tensor_parallel_size=esp, num_experts=8,
                               moe_router_topk=topk, moe_parm_exchange=exchange, **extra)

    assert ep_groups(8, 2, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert relay_size(args(4, 4, 1), 2) == 2
    assert relay_size(args(8, 4, 2), 4) == 2      # ESP 2: {0, 2 | 4, 6}
    assert relay_size(args(8, 4, 2), 8) == 1      # one node
    assert relay_size(args(4, 2, 2), 2) == 1      # one EP rank per node
    assert relay_size(args(4, 4, 1, topk=1), 2) == 1
    assert relay_size(args(4, 4, 1, exchange="direct"), 2) == 1
    assert relay_size(args(6, 3, 2), 4) == 1      # EP ranks 0, 2 | 4: uneven over the nodes
    full = args(4, 4, 1, ranks_per_node=2, seq_length=16, micro_batch_size=2, hidden_size=8,
                moe_ffn_hidden_size=8, moe_expert_capacity_factor=None, bf16=False,
                tensor_model_parallel_size=1, sequence_parallel=False, moe_parm_chunks=1,
                pipeline_model_parallel_size=1)
    assert layer_shape(full).relay == 2 and layer_shape(full, per_node=4).relay == 1
    # without --ranks-per-node: torchrun's LOCAL_WORLD_SIZE says how ranks sit on nodes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    full.ranks_per_node = None
    assert ranks_per_node(full) == 2 and layer_shape(full).relay == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node(full) == 4 and layer_shape(full).relay == 1


def test_exact_exchange_bytes():
    """s1's exact exchange on SHAPE (dropless): rows = N/G x ep_hit per EP rank, M + L wide
    out and M back; the ESP gather sends every held row once to the other ESP rank; no
    padding, so fewer bytes than the padded exchange; s2 gathers the M-wide combined tokens."""
    shape = replace(SHAPE, capacity_factor=None, exact=True, sequence_parallel=True)
    hit = 1 - math.comb(2, 2) / math.comb(4, 2)  # 5/6: a top-2 token misses 2 of 4 experts
    rows, m, local = 64 * hit, 64, 2  # per EP destination, N/G = 64 tokens per MP rank
    exchange = {s: (f, b) for s, f, b in step_bytes("s1", shape, True)}["exchange[ep,esp]"]
    fwd, bwd = exchange
    assert fwd["alltoall/ep"] == pytest.approx(rows * (m + local) * 4 + rows * m * 4, abs=2)
    assert bwd["alltoall/ep"] == pytest.approx(fwd["alltoall/ep"])
    assert fwd["allgather/esp"] == pytest.approx(2 * rows * (m + local) * 4, abs=2)
    assert fwd["reducescatter/esp"] == pytest.approx(2 * rows * m * 4, abs=2)
    padded = dict((s, (f, b)) for s, f, b in step_bytes("s1", replace(shape, exact=False),
                                                         True))["exchange[ep,esp]"]
    assert fwd["alltoall/ep"] < padded[0]["alltoall/ep"]
    s2 = dict((s, (f, b)) for s, f, b in step_bytes("s2", shape, True))["exchange[ep,esp,mp]"]
    assert s2[0]["allgather/mp"] == 64 * m * 4  # this rank's combined 1/G of the tokens


def test_local_first_is_priced_as_its_pieces_run():
    """--moe-parm-local-first in exchange_s: the first local half runs while chunk 0 travels
    out, the second while the last return travels back, and the gathers over MP wait for it;
    in plan_cost, each half pays one more ESP gather and scatter: it wins where the link is
    slow against the ESP calls, and loses where those calls' latency is all there is."""
    from parm_trainer.moe.cost_model import exchange_s

    out, back = (0.0, 10.0), (0.0, 10.0)
    assert exchange_s(out, 4.0, back, (0.0, 0.0), 1) == 24.0
    assert exchange_s(out, 4.0, back, (0.0, 0.0), 1, local=(8.0, 8.0)) == 24.0  # hidden
    # longer halves bound it: 12, then chunk 0 from 12 to 16, its return to 26, 12 more
    assert exchange_s(out, 4.0, back, (0.0, 0.0), 1, local=(12.0, 12.0)) == 28.0
    assert exchange_s(out, 4.0, back, (0.0, 5.0), 1, local=(12.0, 12.0)) == 33.0

    shape = replace(SHAPE, capacity_factor=None, exact=True, chunks=2, sequence_parallel=True,
                    hidden=512, ffn=1024)

    def total(prof, local):
        return plan_cost(build_plan("s1", True), replace(shape, local_first=local),
                         prof)["total_s"]

    # the link and the expert work of a size: the halves hide part of the work (all of it
    # hides under a link far slower, and none is left to hide under a link far faster)
    even = profile(intra_beta=1e-11, inter_beta=1e-8, compute=(0.0, 1e-11))
    assert total(even, True) < 0.85 * total(even, False)
    link_bound = profile(intra_beta=1e-11, inter_beta=1e-8, compute=(0.0, 1e-12))
    assert total(link_bound, True) == pytest.approx(total(link_bound, False))
    calls_only = profile(intra_beta=1e-15, inter_beta=1e-15, alpha=1e-3)
    assert total(calls_only, True) > total(calls_only, False)
    # with ESP 1 the halves add no collectives, and the call count says so
    one = replace(shape, esp=1, mp=1, sequence_parallel=False)
    cost = plan_cost(build_plan("s1", False), replace(one, local_first=True), calls_only)
    assert cost["total_s"] == pytest.approx(
        plan_cost(build_plan("s1", False), one, calls_only)["total_s"])
