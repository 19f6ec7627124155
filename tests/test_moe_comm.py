"""parm_trainer.moe.comm: collectives, their autograd duals, the started/finished ones and
the byte ledger.

One torchrun launch of 4 gloo ranks checks every op on groups of 1, 2 and 4 ranks ({0,1},{2,3};
{0,2},{1,3}; all four; singletons; None) against a reference that each rank computes locally
from every rank's input (single-process autograd on the same values), and checks that
start/finish equal the blocking ops and leave nothing alive after the backward. Inputs are
integer-valued floats, so every sum is exact whatever order a backend adds in, and torch.equal
is the comparison throughout.

    .venv/bin/python -m pytest tests/test_moe_comm.py -q
"""

from __future__ import annotations

import torch

from conftest import run_rank_workers
from parm_trainer.moe.comm import LEDGER, CommLedger, piece_spans
from parm_trainer.moe import comm



def test_collectives_on_four_gloo_ranks(tmp_path):
    reports = run_rank_workers(tmp_path, "worker_moe_comm.py", 4, timeout=180)
    # start/finish: 4 partitions x 4 kinds x 3 checks; 5 op partitions x 13 op cases x 4 checks
    assert [r["checks"] for r in reports] == [4 * 4 * 3 + 5 * 13 * 4] * 4


def test_ledger_sums_and_filters_by_phase():
    ledger = CommLedger()
    ledger.record("alltoall", "ep", 10, 12)
    ledger.record("alltoall", "ep", 1, 2, phase="backward")
    ledger.record("allgather", "esp", 5, 5)
    assert ledger.totals() == {"alltoall/ep": {"sent": 11, "received": 14, "calls": 2},
                               "allgather/esp": {"sent": 5, "received": 5, "calls": 1}}
    assert ledger.totals(phase="backward") == {"alltoall/ep": {"sent": 1, "received": 2,
                                                               "calls": 1}}
    assert set(ledger.totals(per_phase=True)) == {"alltoall/ep/forward", "alltoall/ep/backward",
                                                  "allgather/esp/forward"}
    assert ledger.by_kind(phase="forward") == {
        "alltoall": {"sent": 10, "received": 12, "calls": 1},
        "allgather": {"sent": 5, "received": 5, "calls": 1}}
    ledger.reset()
    assert ledger.totals() == {} and ledger.by_kind() == {}


def test_piece_spans_follow_tensor_split():
    for length in range(0, 9):
        for chunks in range(1, 6):
            pieces = torch.tensor_split(torch.arange(length), chunks)
            expected = [(int(p[0]), len(p)) for p in pieces if len(p)]
            assert piece_spans(length, chunks) == expected


def test_group_of_none_is_identity_and_records_nothing():
    LEDGER.reset()
    x = torch.randn(4, 6, requires_grad=True)
    ops = [lambda t: comm.all_to_all(t, None, "ep"), lambda t: comm.all_gather(t, None, "ep", 1),
           lambda t: comm.reduce_scatter(t, None, "ep"), lambda t: comm.all_reduce(t, None, "ep"),
           lambda t: comm.split(t, None, "mp", 1), lambda t: comm.gather(t, None, "mp", 0),
           lambda t: comm.copy_to(t, None, "mp")]
    for op in ops:
        assert op(x) is x
    assert LEDGER.totals() == {}


def test_the_exchange_takes_pieces_with_nothing_to_carry(monkeypatch):
    """A piece of no token, and a relay hop that received no row over the link (every token
    of the other node routed to that node's own experts, as a collapsed router does): the
    masks and the in-node hop are shaped by their known widths (a view with -1 of no element
    fails), and the hop sends nothing."""
    from types import SimpleNamespace

    from parm_trainer.moe import exchange

    masks = exchange._masks(exchange.Routed(torch.zeros(0, 8), torch.zeros(0, 8)), 4,
                            SimpleNamespace(nodes=2))
    assert masks.goes.shape == (0, 4) and masks.hop_goes.shape == (0, 2)
    assert masks.hop.shape == (0, 2, 4)
    sent = []
    monkeypatch.setattr(exchange.cu, "counts_of", lambda *a, **k: None)
    monkeypatch.setattr(exchange.cu, "run", lambda x, *a: sent.append(x) or x)
    piece = SimpleNamespace(fwd_send=[0, 0], fwd_recv=[0, 0])
    relay = SimpleNamespace(per_node=2, position=0, intra=None)
    rows, came_from = exchange._forward_in_node(torch.zeros(0, 8 + 2 * 3), piece, relay, 8)
    assert rows.shape == (0, 8 + 3) and came_from.shape == (0,) and sent[0].shape == (0, 11)
