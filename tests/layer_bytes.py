"""The bytes the MoE layer's exchanges must send, counted here from PARM.md's volumes and from
the routing of every rank's tokens, independently of the cost model and the ledger
(tests/test_moe_layer.py compares bench_moe_layer's ledger figures with them)."""

from __future__ import annotations

import math

import torch


def expected_forward_bytes(schedule, mp, ep, esp, sp, n, m, e, k, f):
    """Sent bytes per rank of one forward pass, from PARM.md's volumes and comm.py's ring
    formulas (4-byte elements): alltoall sends (W-1)/W of its input, allgather (W-1) times its
    piece, reducescatter (W-1)/W of its input, allreduce 2 (W-1)/W."""
    cap = math.ceil(n * k / e * f)              # baseline / s2: one gate call on N tokens
    cap_s1 = math.ceil((n // mp) * k / e * f)   # s1: one gate call on N/G tokens
    local = {"baseline": cap, "s1": cap_s1, "s2": cap // mp}[schedule]
    block = e * local * m * 4                   # the dispatched (E, C_local, M) tensor
    out = {"alltoall": 2 * block * (ep - 1) // ep}
    if schedule == "baseline":
        out["allreduce"] = 2 * block * (esp - 1) // esp
    else:
        out["allgather"] = block * (esp - 1)                   # ESP-AllGather
        out["reducescatter"] = block * esp * (esp - 1) // esp  # ESP-ReduceScatter
        if schedule == "s2":
            out["allgather"] += block * (mp - 1)                # MP-AllGather of the capacity
    tokens = (n // mp) * m * 4 * (mp - 1)  # MP-AllGather of a 1/G token slice
    if (schedule == "s1") != sp:  # s1's output without SP; baseline's and s2's input with SP
        out["allgather"] = out.get("allgather", 0) + tokens
    return out, cap, cap_s1


def check_exact_bytes(run, dump, mp, ep, esp, topk, world=4, schedules=("s1", "s2"),
                      groups=None):
    """The exact exchange's AlltoAll bytes on every rank, each direction and phase, equal the
    unique payload counted from the routing: each token once to each other EP rank holding
    one of its experts, hidden + E/EP weights wide, and one row of hidden back. The ESP
    AllGather (s1 under SP: the only allgather) sends every row the rank received, incl. its
    own, to each other ESP rank. Megatron's rank order: MP innermost for the dense layout;
    ESP, then EP, then expert-DP for the experts."""
    mine, hidden = routing_of(dump, mp, world, topk, groups)
    local = next(iter(mine.values())).shape[1] // ep
    ep_of = lambda r: (r // esp) % ep  # noqa: E731
    peer = lambda r, j: r + (j - ep_of(r)) * esp  # noqa: E731  the rank of EP index j
    rows = {(r, j): int(mine[r][:, j * local:(j + 1) * local].any(dim=1).sum())
            for r in range(world) for j in range(ep)}
    assert sum(rows.values()) > world * 4  # something crosses
    for schedule in schedules:
        sent, received = run["schedules"][schedule]["bytes"], \
            run["schedules"][schedule]["bytes_received"]
        for r in range(world):
            out = sum(rows[r, j] for j in range(ep) if j != ep_of(r))
            into = sum(rows[peer(r, j), ep_of(r)] for j in range(ep) if j != ep_of(r))
            fwd_sent = 4 * (out * (hidden + local) + into * hidden)
            fwd_received = 4 * (into * (hidden + local) + out * hidden)
            want = {("forward", "sent"): fwd_sent, ("forward", "received"): fwd_received,
                    ("backward", "sent"): fwd_received, ("backward", "received"): fwd_sent}
            for (phase, way), value in want.items():
                got = (sent if way == "sent" else received)[phase]["alltoall"][r]
                assert got == value, (run["name"], schedule, r, phase, way, got, value)
            if schedule.startswith("s1") and mp > 1 and esp > 1:
                held = sum(rows[peer(r, j), ep_of(r)] for j in range(ep))
                assert sent["forward"]["allgather"][r] == 4 * held * (hidden + local) * (esp - 1)


def group_limited(logits, topk, groups, group_topk):
    """DeepSeek-V3's group-limited routing map with sigmoid scores, from its definition: a
    group's score is the sum of its best topk / group_topk expert scores; each token keeps its
    group_topk best groups and its topk best experts among theirs."""
    scores = torch.sigmoid(logits)
    tokens, experts = scores.shape
    per_group = scores.view(tokens, groups, experts // groups)
    group_score = per_group.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    best = group_score.topk(group_topk, dim=-1).indices
    allowed = torch.zeros(tokens, groups, dtype=torch.bool).scatter(1, best, True)
    allowed = allowed.repeat_interleave(experts // groups, dim=1)
    chosen = scores.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1).indices
    return torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, chosen, True)


def routing_of(dump, mp, world, topk, groups=None):
    """rank -> the routing map (tokens, E) of the tokens it gates and sends (s1's split);
    groups: (num groups, group top-k) of sigmoid group-limited routing."""
    from parm_trainer.moe.reference import route

    gate = torch.load(dump / "weights.pt")["gate"]
    mine = {}
    for d in range(world // mp):
        logits = torch.load(dump / f"input_dp{d}.pt") @ gate.t()
        routing = (group_limited(logits, topk, *groups) if groups
                   else route(logits, topk)[1])
        for g, block in enumerate(routing.chunk(mp)):
            mine[d * mp + g] = block
    return mine, gate.shape[1]


def check_relay_bytes(run, dump, mp, ep, esp, topk, per_node, world=4, groups=None):
    """The relayed exchange's bytes against the routing (R = EP ranks per node): over the link
    ("ep_link") each token once to each other node holding one of its experts, hidden + R L
    weights wide, one row of hidden back; inside the node ("ep_node") each row a relay
    received (its own tokens' and its peers' at its position on the other nodes) once to each
    other rank of its node whose experts it needs, hidden + L wide, one row back."""
    mine, hidden = routing_of(dump, mp, world, topk, groups)
    experts = next(iter(mine.values())).shape[1]
    local, ranks_here = experts // ep, per_node // esp  # EP ranks of one group on a node
    ep_of = lambda r: (r // esp) % ep  # noqa: E731
    peer = lambda r, j: r + (j - ep_of(r)) * esp  # noqa: E731  the rank of EP index j
    node = lambda j: j // ranks_here  # noqa: E731  of an EP index
    nodes = ep // ranks_here
    to_rank = {(r, j): int(mine[r][:, j * local:(j + 1) * local].any(dim=1).sum())
               for r in range(world) for j in range(ep)}
    span = ranks_here * local
    to_node = {(r, b): int(mine[r][:, b * span:(b + 1) * span].any(dim=1).sum())
               for r in range(world) for b in range(nodes)}
    assert sum(to_node.values()) < sum(to_rank.values())  # the relay saves link rows here
    if groups and groups[0] == nodes:  # node-limited: a token's rows go to group-topk nodes
        for r in range(world):
            reached = torch.stack([mine[r][:, b * span:(b + 1) * span].any(dim=1)
                                   for b in range(nodes)], dim=1).sum(dim=1)
            assert int(reached.max()) <= groups[1], (r, reached.tolist())
    for schedule in ("s1", "s2"):
        by_group = {way: run["schedules"][schedule][key]["by_group"]
                    for way, key in (("sent", "bytes"), ("received", "bytes_received"))}
        for r in range(world):
            j = ep_of(r)
            pos, home = j % ranks_here, node(j)
            out = sum(to_node[r, b] for b in range(nodes) if b != home)
            into = sum(to_node[peer(r, b * ranks_here + pos), home]
                       for b in range(nodes) if b != home)
            link = (4 * (out * (hidden + span) + into * hidden),
                    4 * (into * (hidden + span) + out * hidden))
            senders = lambda p: [peer(r, b * ranks_here + p) for b in range(nodes)]  # noqa
            fwd = sum(to_rank[s, home * ranks_here + q] for q in range(ranks_here) if q != pos
                      for s in senders(pos))
            got = sum(to_rank[s, j] for q in range(ranks_here) if q != pos for s in senders(q))
            inside = (4 * (fwd * (hidden + local) + got * hidden),
                      4 * (got * (hidden + local) + fwd * hidden))
            for group, (sent, received) in (("ep_link", link), ("ep_node", inside)):
                want = {("forward", "sent"): sent, ("forward", "received"): received,
                        ("backward", "sent"): received, ("backward", "received"): sent}
                for (phase, way), value in want.items():
                    value_got = by_group[way][phase][f"alltoall/{group}"][r]
                    assert value_got == value, (schedule, r, group, phase, way, value_got, value)
            assert "alltoall/ep" not in by_group["sent"]["forward"]
