"""The cost model prices the plans the executor runs: its bytes are comm.py's ledger formulas on
hand-computed shapes, backward mirrors forward, the exchange in pieces follows its schedule, the
schedule choice follows the arithmetic, alpha/beta fits recover known values, profiles
round-trip through JSON, and the paper-scale simulator runs. Single process, no torch.
"""

import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from parm_trainer.errors import ProfileError
from parm_trainer.moe.cost_model import choose_schedule, exchange_s, plan_cost, step_load, walk
from parm_trainer.moe.cost_profile import DEFAULT_PROFILE, KINDS, Profile, fit_alpha_beta
from parm_trainer.moe.cost_shape import LayerShape, remote_share
from parm_trainer.moe.schedules import build_plan

ROOT = Path(__file__).resolve().parents[1]

# MP = ESP = EP = 2, N = 128 tokens, top-2, f = 1, E = 4, M = 64, fp32.
SHAPE = LayerShape(tokens=128, hidden=64, ffn=128, experts=4, topk=2, capacity_factor=1.0,
                   bytes_per_element=4, mp=2, ep=2, esp=2)


def profile(intra_beta=1e-9, inter_beta=1e-9, alpha=0.0, gpus_per_node=2, compute=(0.0, 0.0)):
    """Every kind alike; alpha 0 and no compute make a plan's seconds its bytes times beta."""
    return Profile(gpus_per_node=gpus_per_node, compute=compute,
                   collectives={k: {"intra": (alpha, intra_beta), "inter": (alpha, inter_beta)}
                                for k in KINDS})


def step_bytes(name, shape=SHAPE, sequence_parallel=False):
    cost = plan_cost(build_plan(name, sequence_parallel), shape, DEFAULT_PROFILE)
    return [(row["step"], row["forward_bytes"], row["backward_bytes"]) for row in cost["steps"]]


def test_baseline_bytes():
    # C = ceil(128 * 2 / 4 * 1.0) = 64; dispatched (E, C, M) = 4 * 64 * 64 * 4 B = 65536 B
    # AlltoAll over EP=2 sends 65536 * (2-1)/2 = 32768; AllReduce over ESP=2 sends
    # 2 * 65536 * (2-1)/2 = 65536 (forward after the expert, backward at the copy).
    assert step_bytes("baseline") == [
        ("gate", {}, {}), ("dispatch", {}, {}),
        ("a2a[ep]", {"alltoall/ep": 32768}, {"alltoall/ep": 32768}),
        ("copy[esp]", {}, {"allreduce/esp": 65536}),
        ("expert", {}, {}),
        ("allreduce[esp]", {"allreduce/esp": 65536}, {}),
        ("a2a[ep]", {"alltoall/ep": 32768}, {"alltoall/ep": 32768}),
        ("combine", {}, {})]


def test_s1_bytes():
    # Each MP rank keeps 64 tokens: C = ceil(64 * 2 / 4) = 32, (E, 32, M) = 32768 B.
    # AlltoAll 32768/2 = 16384; ESP AllGather of the 32768 B piece sends 32768 * (2-1);
    # ReduceScatter of (E, 64, M) = 65536 B sends 65536/2 = 32768; MP AllGather of the
    # (64, 64) fp32 output piece sends 16384; the split gate's weight gradient (E x M fp32 =
    # 1024 B) is all-reduced over MP in the backward: 2 * 1024 / 2 = 1024, and in the forward
    # megatron's router all-reduces the 4 int64 token counts for the aux loss: 2 * 32 / 2 = 32.
    # The exchange sends each AlltoAll twice (out and back) and, backward, the ESP gather's
    # and scatter's duals (ReduceScatter and AllGather) of the same bytes.
    exchange = {"alltoall/ep": 2 * 16384, "allgather/esp": 32768, "reducescatter/esp": 32768}
    assert step_bytes("s1") == [
        ("split_tokens[mp]", {}, {"allgather/mp": 16384}),
        ("gate[mp]", {"allreduce/mp": 32}, {"allreduce/mp": 1024}),
        ("dispatch", {}, {}),
        ("exchange[ep,esp]", exchange, exchange),
        ("combine", {}, {}),
        ("gather_tokens[mp]", {"allgather/mp": 16384}, {})]
    # under sequence parallelism tokens arrive split: no MP gather, the same exchange
    split = replace(SHAPE, sequence_parallel=True)
    assert step_bytes("s1", split, True)[2:4] == step_bytes("s1")[3:5]


def test_s2_bytes():
    # Gate on all 128 tokens, C = 64 split over MP to 32: the exchange moves s1's bytes, and
    # its unified AlltoAll back + MP AllGather of the (E, 32, M) pieces sends 32768 more
    # (backward: each MP rank keeps its block, then the AlltoAll); the backward of
    # split_capacity is the MP AllGather of the (E, 32, M) piece, 32768.
    s1 = dict((step, (f, b)) for step, f, b in step_bytes("s1"))
    forward, backward = s1["exchange[ep,esp]"]
    assert step_bytes("s2") == [
        ("gate", {}, {}), ("dispatch", {}, {}),
        ("split_capacity[mp]", {}, {"allgather/mp": 32768}),
        ("exchange[ep,esp,mp]", {**forward, "allgather/mp": 32768}, backward),
        ("combine", {}, {})]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_alltoall_halved_and_backward_mirrors(sequence_parallel):
    shape = replace(SHAPE, sequence_parallel=True) if sequence_parallel else SHAPE
    sent = {name: plan_cost(build_plan(name, sequence_parallel), shape, DEFAULT_PROFILE)["bytes"]
            for name in ("baseline", "s1", "s2")}
    for name in ("s1", "s2"):
        for phase in ("forward", "backward"):
            assert 2 * sent[name][phase]["alltoall/ep"] == sent["baseline"][phase]["alltoall/ep"]
    for name, by_phase in sent.items():
        forward, backward = by_phase["forward"], by_phase["backward"]
        assert forward["alltoall/ep"] == backward["alltoall/ep"]
        # AllGather <-> ReduceScatter over ESP: the same bytes each way
        assert forward.get("allgather/esp") == backward.get("reducescatter/esp")
        assert forward.get("reducescatter/esp") == backward.get("allgather/esp")
        # MP AllGathers: a forward gather is a backward split and the other way round
        # s1's gate weight gradient, backward only; under sequence parallelism it is summed
        # once per iteration by finalize_model_grads instead
        extra = 1024 if name == "s1" and not sequence_parallel else 0
        assert backward.get("allreduce/mp", 0) == extra
        assert forward.get("allgather/mp") == backward.get("allgather/mp")


def test_expert_flops_and_capacity_state():
    # baseline expert on (E, C, M) = 4 x 64 slots at H/ESP = 64: 2 * 256 * 64 * 64 * 2 flops
    rows = plan_cost(build_plan("baseline", False), SHAPE, DEFAULT_PROFILE)["steps"]
    assert rows[4]["step"] == "expert" and rows[4]["flops"] == 2 * 256 * 64 * 64 * 2
    # s1's exchange holds 32 slots and gathers them over ESP = 2 for the expert: 64 slots, the
    # same rows and flops as the baseline
    held = dict((str(step), h) for step, h in walk(build_plan("s1", False), SHAPE))
    assert held["exchange[ep,esp]"].capacity == 32 and held["gate[mp]"].tokens == 64
    rows = plan_cost(build_plan("s1", False), SHAPE, DEFAULT_PROFILE)["steps"]
    assert rows[3]["step"] == "exchange[ep,esp]" and rows[3]["flops"] == 2 * 256 * 64 * 64 * 2
    # dropless: the expected largest of E = 8 loads ~ N(12.5, 3.31^2): z(8) = 1.43 -> 17.2 ->
    # 18, rounded up to MP = 4 where the plan splits it
    dropless = LayerShape(tokens=100, hidden=8, ffn=8, experts=8, topk=1, capacity_factor=None,
                          mp=4, ep=2, esp=4)
    assert dropless.capacity(100) == 18 and dropless.capacity(100, multiple=4) == 20
    held = dict((str(step), h) for step, h in walk(build_plan("s2", False), dropless))
    assert held["split_capacity[mp]"].capacity == 20


@pytest.mark.parametrize("tokens,experts,topk,mp,dp", [
    (512, 4, 2, 4, 1), (1024, 4, 3, 4, 1), (256, 8, 2, 2, 2), (8192, 16, 2, 8, 4),
    (128, 4, 2, 2, 2), (100, 8, 1, 4, 1)])
def test_dropless_capacity_matches_random_routing(tokens, experts, topk, mp, dp):
    """The dropless capacity estimate against a Monte Carlo of random top-k routing: each of
    the stage's gate calls routes every token to k distinct uniformly drawn experts, and the
    capacity is the largest load over all calls. Split tokens (s1: MP x DP calls on N/MP
    tokens) and whole tokens (s2: DP calls on N) each within 4 %."""
    shape = LayerShape(tokens=tokens, hidden=8, ffn=8, experts=experts, topk=topk,
                       capacity_factor=None, mp=mp, ep=1, esp=mp, dp=dp)
    rng = np.random.default_rng(0)
    for n, calls in ((tokens // mp, mp * dp), (tokens, dp)):
        trials = []
        for _ in range(200):
            choice = np.argsort(rng.random((calls, n, experts)), axis=-1)[..., :topk]
            loads = np.stack([np.bincount(c.ravel(), minlength=experts) for c in choice])
            trials.append(loads.max())
        assert shape.capacity(n) == pytest.approx(np.mean(trials), rel=0.04)


def test_layouts_the_executor_refuses_are_refused():
    # s2 with a capacity factor: C = ceil(128 * 1 / 4 * 1.2) = 39 does not split over MP 2
    odd = LayerShape(tokens=128, hidden=8, ffn=8, experts=4, topk=1, capacity_factor=1.2,
                     mp=2, ep=2, esp=2)
    with pytest.raises(ValueError, match="capacity 39"):
        plan_cost(build_plan("s2", False), odd, DEFAULT_PROFILE)
    name, totals = choose_schedule(odd, DEFAULT_PROFILE)
    assert name == "s1" and math.isinf(totals["s2"])
    padded = replace(odd, pad_capacity=True)  # the what-if: 39 -> 40
    assert dict((str(s), h) for s, h in walk(build_plan("s2", False), padded))[
        "split_capacity[mp]"].capacity == 40
    with pytest.raises(ValueError, match="ESP"):  # DeepSpeed TED needs ESP = MP
        plan_cost(build_plan("baseline", False), replace(SHAPE, esp=1, ep=4), DEFAULT_PROFILE)


def test_one_piece_exchange_is_the_sum_of_its_collectives():
    # s1's exchange at r = 1: AlltoAll 16384 B over EP (inter: gpus_per_node 2, EP stride 2)
    # at 1e-8 s/B = 163.84 us, out and back; ESP AllGather 32768 B and ReduceScatter 32768 B
    # (intra) at 1e-9 = 32.768 us each; backward their duals, the same bytes. No compute.
    prof = profile(intra_beta=1e-9, inter_beta=1e-8)
    expected = 2 * 16384 * 1e-8 + 2 * 32768 * 1e-9
    row = plan_cost(build_plan("s1", False), SHAPE, prof)["steps"][3]
    assert row["step"] == "exchange[ep,esp]"
    assert row["forward_s"] == pytest.approx(expected)
    assert row["backward_s"] == pytest.approx(expected)
    # in 4 pieces the AlltoAlls stream back to back and the ESP work hides under them: the
    # link's time out and back is all that is left
    piped = plan_cost(build_plan("s1", False), replace(SHAPE, chunks=4), prof)["steps"][3]
    assert piped["forward_s"] == pytest.approx(2 * 16384 * 1e-8)


def test_layer_terms_add_per_step_and_per_call_costs():
    """host_s_per_step is paid by every step, s_per_call by every collective call: s1 at MP =
    EP = ESP = 2 without SP calls, forward, the router-count AllReduce and the MP AllGather,
    and in its exchange of r pieces r AlltoAlls, r AllGathers, r ReduceScatters and r
    AlltoAlls back: 2 + 4r; backward, the split's AllGather, the gate weight's AllReduce and
    the exchange's 4r. The exchange's calls take the main thread's time of their piece, so
    where the main thread bounds the exchange (here: collectives without transfer time) each
    adds in full."""
    prof = profile(alpha=1e-5)
    for chunks in (1, 2):
        shape = replace(SHAPE, chunks=chunks)
        plain = plan_cost(build_plan("s1", False), shape, prof)
        per_step = plan_cost(build_plan("s1", False), shape,
                             replace(prof, layer=(1.0, 1.0, 1e-3, 0.0)))
        per_call = plan_cost(build_plan("s1", False), shape,
                             replace(prof, layer=(1.0, 1.0, 0.0, 1e-3)))
        steps = len(build_plan("s1", False).steps)
        assert per_step["total_s"] - plain["total_s"] == pytest.approx(3 * steps * 1e-3)
        calls = 2 + 4 * chunks
        assert per_call["forward_s"] - plain["forward_s"] == pytest.approx(calls * 1e-3)
        assert per_call["backward_s"] - plain["backward_s"] == pytest.approx(calls * 1e-3)


def test_the_exact_exchange_carries_s1s_router_counts():
    """s1's gate sums the router's per-expert counts over MP in an AllReduce of its own, except
    on the exact exchange where the EP x ESP group holds the MP group (EP x ESP a multiple of
    MP): there the exchange's count AllGather carries them (aux_loss.py)."""
    plan = build_plan("s1", True)

    def gate_forward(**sizes):
        shape = replace(SHAPE, capacity_factor=None, sequence_parallel=True, **sizes)
        (step, held), = [(st, h) for st, h in walk(plan, shape) if st.op == "gate"]
        return [kind for kind, *_ in step_load(step, shape, held)[0].forward]

    assert gate_forward(exact=False) == ["allreduce"]
    assert gate_forward(exact=True) == []
    assert gate_forward(exact=True, mp=2, ep=2, esp=1) == []
    assert gate_forward(exact=True, mp=4, ep=2, esp=1) == ["allreduce"]


def test_a_busy_link_hides_the_calls_of_later_pieces():
    """Where the link bounds a pipelined exchange, a piece's calls run on the main thread
    while other pieces cross it: at r = 4 on a slow link only the 2 calls outside the
    exchange (the router counts' AllReduce, the MP AllGather) add their s_per_call; at r = 1
    nothing overlaps and all 2 + 4 add."""
    prof = profile(inter_beta=1e-6, compute=(0.0, 1e-12))
    waiting = replace(prof, layer=(1.0, 1.0, 0.0, 1e-3))
    added = {}
    for chunks in (1, 4):
        shape = replace(SHAPE, chunks=chunks)
        plain, paid = (plan_cost(build_plan("s1", False), shape, p)["forward_s"]
                       for p in (prof, waiting))
        added[chunks] = (paid - plain) / 1e-3
    assert added[1] == pytest.approx(2 + 4 * 1)
    assert added[4] == pytest.approx(2)


def test_group_placement():
    # megatron order: ESP consecutive, EP stride ESP. 8 GPUs per node, 32 GPUs, MP=ESP=8, EP=4:
    # the ESP group is a node, the EP group spans the 4 nodes.
    assert remote_share(8, 1, 8) == 0 and remote_share(4, 8, 8) > 0
    # 8 GPUs, MP=ESP=2, EP=4 (stride 2, span 8): one node of 8, two nodes of 4
    assert remote_share(4, 2, 8) == 0 and remote_share(4, 2, 4) > 0 and remote_share(2, 1, 4) == 0
    assert remote_share(3, 1, 8) > 0  # groups of 3 straddle the node boundary at rank 8
    shape = LayerShape(tokens=8, hidden=8, ffn=8, experts=4, topk=1, capacity_factor=1.0,
                       mp=8, ep=4, esp=8)
    ring = DEFAULT_PROFILE.collectives["allgather"]
    assert DEFAULT_PROFILE.price("allgather", shape, "ep") == ring["inter"]
    assert DEFAULT_PROFILE.price("allgather", shape, "esp") == \
        DEFAULT_PROFILE.price("allgather", shape, "mp") == ring["intra"]
    # the share of a member's peers on other nodes, counted member by member
    assert remote_share(4, 8, 8) == 1.0 and remote_share(8, 1, 8) == 0.0
    assert remote_share(4, 1, 2) == pytest.approx(2 / 3)  # 2 nodes of 2: 2 of 3 peers remote
    assert remote_share(8, 1, 4) == pytest.approx(4 / 7)
    assert remote_share(3, 1, 8) == 1.0  # the group straddling rank 8 has a lone member


def test_alltoall_across_nodes_pays_the_network_rate_only_for_remote_peers():
    """EP 4 on 2 nodes of 2 ranks (ESP 1): each rank's AlltoAll keeps 1 of its 3 peers' blocks
    in the node, so only 2/3 of its bytes cross; ring collectives on the same group run at
    the network rate whole (their slowest hop)."""
    shape = LayerShape(tokens=512, hidden=64, ffn=128, experts=4, topk=2, capacity_factor=1.0,
                       bytes_per_element=4, mp=2, ep=4, esp=1)
    profile = replace(DEFAULT_PROFILE, gpus_per_node=2, compute=(0.0, 0.0))
    alpha, beta = profile.collectives["alltoall"]["inter"]
    assert profile.price("alltoall", shape, "ep") == (alpha, pytest.approx(beta * 2 / 3))
    assert profile.price("allgather", shape, "ep") == profile.collectives["allgather"]["inter"]
    two = replace(shape, ep=2, experts=2)  # EP 2 at stride 1 on nodes of 2: inside a node
    assert profile.price("alltoall", two, "ep") == profile.collectives["alltoall"]["intra"]
    # in a plan: s1's exchange (ESP 1: AlltoAll out and back, no compute priced) pays that
    row = plan_cost(build_plan("s1", False), shape, profile)["steps"][3]
    assert row["step"] == "exchange[ep,esp]"
    sent = row["forward_bytes"]["alltoall/ep"] / 2
    assert sent > 0 and row["forward_bytes"] == row["backward_bytes"] == {"alltoall/ep": 2 * sent}
    assert row["forward_s"] == row["backward_s"] == pytest.approx(2 * (alpha + sent * beta * 2 / 3))


def test_choose_schedule_follows_the_mp_gather_bytes():
    """With MP = ESP = 2 inside a node and EP across nodes, s1 and s2 move the same AlltoAll
    and ESP bytes; they differ in the MP AllGathers: s1 gathers the N*M tokens, s2 the
    dispatched (E, C, M) = k*f*N*M. Zero alphas and compute: seconds = bytes * beta."""
    prof = profile(intra_beta=1e-9, inter_beta=1e-8)
    # top-2, f = 1 (SHAPE): AlltoAll 4 x 16384 B inter in both = 655.36 us.
    # s1 intra: forward 32768 + 32768 + 16384 + 32 (router counts), backward the same
    #   + 1024 (gate weight) = 164896 B = 164.896 us; s2 intra: 3 x 32768 each way
    #   = 196608 B = 196.608 us.
    name, totals = choose_schedule(SHAPE, prof, ("baseline", "s1", "s2"))
    assert name == "s1"
    assert totals["s1"] == pytest.approx(655.36e-6 + 164.896e-6)
    assert totals["s2"] == pytest.approx(655.36e-6 + 196.608e-6)
    # baseline: AlltoAll 4 x 32768 inter = 1310.72 us, AllReduce 2 x 65536 intra = 131.072 us
    assert totals["baseline"] == pytest.approx(1310.72e-6 + 131.072e-6)
    # top-1, f = 0.5: s2's C = 16 -> 8 per MP rank, s1's C = ceil(64 / 4 * 0.5) = 8, so the
    # pairs match (AlltoAll 4 x 4096 B = 163.84 us); MP gathers: s1 16384 B each way (+1024),
    # s2 (E, 8, M) = 8192 B each way. s1 intra 66592 B (with the 32 B of router counts),
    # s2 intra 49152 B.
    sparse = replace(SHAPE, topk=1, capacity_factor=0.5)
    name, totals = choose_schedule(sparse, prof)
    assert name == "s2"
    assert totals["s1"] == pytest.approx(163.84e-6 + 66.592e-6)
    assert totals["s2"] == pytest.approx(163.84e-6 + 49.152e-6)


def test_fit_alpha_beta_recovers_known_values():
    rng = np.random.default_rng(0)
    sizes = np.geomspace(1e3, 1e9, 40)
    alpha, beta = 25e-6, 1 / 22e9
    seconds = alpha + beta * sizes
    seconds = seconds * (1 + 1e-3 * rng.standard_normal(sizes.size))
    fit_a, fit_b, r2 = fit_alpha_beta(sizes, seconds)
    assert r2 > 0.999
    assert fit_b == pytest.approx(beta, rel=1e-2)
    assert fit_a == pytest.approx(alpha, rel=0.2)
    exact = fit_alpha_beta([1, 2, 3], [5.0, 7.0, 9.0])
    assert exact == pytest.approx((3.0, 2.0, 1.0))


def test_profile_json_round_trip(tmp_path):
    assert Profile.from_json(DEFAULT_PROFILE.to_json()) == DEFAULT_PROFILE
    path = tmp_path / "profile.json"
    DEFAULT_PROFILE.to_json(str(path))
    assert Profile.from_json(str(path)) == DEFAULT_PROFILE
    gloo = replace(DEFAULT_PROFILE, lanes=2)
    assert Profile.from_json(gloo.to_json()) == gloo
    # the shipped A100 cluster file holds DEFAULT_PROFILE's numbers in readable units
    a100 = Profile.from_json(str(ROOT / "tools/clusters/a100-nvlink-8x.json"))
    assert a100.gpus_per_node == DEFAULT_PROFILE.gpus_per_node
    for kind in KINDS:
        for link in ("intra", "inter"):
            assert a100.collectives[kind][link] == pytest.approx(
                DEFAULT_PROFILE.collectives[kind][link])
    assert a100.compute == pytest.approx(DEFAULT_PROFILE.compute)
    assert Profile.from_json(str(ROOT / "tools/clusters/pcie-4x.json")).gpus_per_node == 4


def _broken(edit):
    data = json.loads(DEFAULT_PROFILE.to_json())
    edit(data)
    return json.dumps(data)


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.pop("compute"), "missing keys ['compute']"),
    (lambda d: d.update(gpus=8), "unknown keys ['gpus']"),
    (lambda d: d.update(gpus_per_node=0), "gpus_per_node must be a positive integer"),
    (lambda d: d["collectives"].pop("allreduce"), "collectives must have exactly the kinds"),
    (lambda d: d["collectives"]["alltoall"].pop("inter"), "collectives.alltoall must have"),
    (lambda d: d["collectives"]["alltoall"]["intra"].update(alpha=-1e-6),
     "collectives.alltoall.intra: alpha must be >= 0 and beta > 0"),
    (lambda d: d["collectives"]["allgather"].update(inter={"alpha_us": 5, "GBps": 0}),
     "collectives.allgather.inter: GBps must be positive"),
    (lambda d: d["compute"].update(beta="fast"), "compute: values must be numbers"),
    (lambda d: d["compute"].update(alpha=float("nan")), "compute: values must be finite"),
    (lambda d: d["compute"].update(gbps=3), "compute: expected"),
    (lambda d: d.update(world_size=-4), "world_size must be a positive integer"),
    (lambda d: d.update(lanes=0), "lanes must be a positive integer"),
    (lambda d: d.update(lanes=True), "lanes must be a positive integer"),
    (lambda d: d.update(layer={"comm_factor": 2.0, "per_step": 1e-4}), "layer must have some of"),
    (lambda d: d.update(layer={"s_per_call": -1e-4}), "s_per_call >= 0"),
    (lambda d: d.update(burst_bytes=-1), "burst_bytes must be a number >= 0"),
    (lambda d: d.update(burst_bytes="big"), "burst_bytes must be a number >= 0"),
])
def test_malformed_profile_is_refused(edit, message):
    with pytest.raises(ProfileError) as error:
        Profile.from_json(_broken(edit))
    assert message in str(error.value)


def test_profile_file_errors_name_the_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match=f"cost profile {path}: not valid JSON"):
        Profile.from_json(str(path))
    with pytest.raises(ProfileError, match="cannot read"):
        Profile.from_json(str(tmp_path / "missing.json"))


def test_profile_of_another_world_size_is_refused(tmp_path):
    from parm_trainer.arguments import parse_args
    from parm_trainer.schedule.auto import resolve_auto_schedule

    path = tmp_path / "calibrated.json"
    replace(DEFAULT_PROFILE, world_size=4).to_json(str(path))
    argv = ["--num-experts", "4", "--moe-parm-schedule", "auto", "--tensor-model-parallel-size",
            "2", "--moe-parm-cost-profile", str(path)]
    said = []
    args = parse_args(argv, world_size=4)
    resolve_auto_schedule(args, log=said.append)  # the world it was measured on: used
    assert args.moe_parm_schedule in ("s1", "s2") and str(path) in said[0]
    with pytest.raises(ProfileError, match="measured on 4 ranks, this job has 8"):
        resolve_auto_schedule(parse_args(argv, world_size=8), log=said.append)
    # a fixed schedule does not use the profile, but a bad one is still refused
    with pytest.raises(ProfileError, match="measured on 4 ranks"):
        resolve_auto_schedule(parse_args([*argv, "--moe-parm-schedule", "s1"], world_size=2))


def test_simulate_cluster_small_grid(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("simulate_cluster",
                                                  ROOT / "tools/simulate_cluster.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "sim.json"
    rows = tool.main(["--cluster", "pcie-4x", "--batch", "4", "--seq", "512,1024",
                      "--hidden", "1024", "--ffn-ratio", "4", "--experts", "8,16",
                      "--topk", "1,2", "--capacity-factor", "1.0,none",
                      "--layouts", "8:2,32:8", "--chunks", "2", "--what-if",
                      "--json", str(out), "--png", str(tmp_path / "hist.png")])
    text = capsys.readouterr().out
    assert len(rows) == 2 * 2 * 2 * 2 * 2
    for word in ("min", "median", "max", "auto", "s2spec", "by MP size", "by tokens"):
        assert word in text
    saved = json.loads(out.read_text())
    assert len(saved["configs"]) == len(rows) and saved["cluster"]["gpus_per_node"] == 4
    assert all(row["auto"] in ("s1", "s2") and row["speedup"]["auto"] > 0 for row in rows)
    assert "skipped" in text or (tmp_path / "hist.png").exists()


def test_pipeline_formula():
    """exchange_s with per-chunk (alpha, transfer) streams: r = 1 is the sum; streamed
    AlltoAlls pay one latency; main work no longer than the link's hides behind it."""
    none = (0.0, 0.0)
    assert exchange_s((0.1, 1.0), 1.0, (0.1, 1.0), (0.05, 0.5), 1) == pytest.approx(3.75)
    # totals: out 1, back 1, main 1, in 4 pieces: the link is busy 2 s, the main work hides
    assert exchange_s((0.0, 0.25), 0.25, (0.0, 0.25), none, 4) == pytest.approx(2.0)
    # a latency: the outbound stream pays it once; the returns queue behind a busy link
    assert exchange_s((0.1, 0.25), 0.25, (0.1, 0.25), none, 4) == pytest.approx(2.1)
    # compute-bound: main 4 s in total; the first outbound and the last return stick out
    assert exchange_s((0.0, 0.25), 1.0, (0.0, 0.25), none, 4) == pytest.approx(0.25 + 4.0 + 0.25)
    # two lanes (gloo): the two outbound pieces share the link and land together at 1 s, so
    # nothing overlaps the first piece's work (one lane: 0.5 s sooner); r = 1 is unchanged
    assert exchange_s((0.0, 0.5), 0.5, (0.0, 0.5), none, 2, lanes=1) == pytest.approx(2.0)
    assert exchange_s((0.0, 0.5), 0.5, (0.0, 0.5), none, 2, lanes=2) == pytest.approx(2.5)
    assert exchange_s((0.1, 1.0), 1.0, (0.1, 1.0), (0.05, 0.5), 1, lanes=2) == \
        pytest.approx(3.75)


@pytest.mark.parametrize("name,group", [("s1", "ep,esp"), ("s2", "ep,esp,mp")])
def test_pipelined_plans_move_the_same_bytes(name, group):
    """The exchange in 4 pieces sends exactly the bytes of one piece (the executor's ledger
    records the same), and with the collectives costing more than the expert it is priced
    below one piece."""
    plan = build_plan(name, False)
    assert f"exchange[{group}]" in [str(s) for s in plan.steps]
    prof = profile(alpha=1e-6, compute=(1e-6, 1e-12))
    a, b = plan_cost(plan, replace(SHAPE, chunks=4), prof), plan_cost(plan, SHAPE, prof)
    assert a["bytes"] == b["bytes"]
    assert a["total_s"] < b["total_s"]
