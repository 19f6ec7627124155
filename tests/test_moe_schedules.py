"""The schedules as data: each plan lists PARM.md's steps in order, and layouts a schedule
cannot run are refused before anything starts."""

import statistics
from pathlib import Path

import pytest

from parm_trainer.arguments import parse_args
from parm_trainer.moe.schedules import build_plan
from parm_trainer.errors import LayoutError
from parm_trainer.planning.checks import validate_layout

ROOT = Path(__file__).resolve().parents[1]


def ops(name, sequence_parallel=False):
    return [str(step) for step in build_plan(name, sequence_parallel).steps]


def test_baseline_is_deepspeed_ted():
    assert ops("baseline") == ["gate", "dispatch", "a2a[ep]", "copy[esp]", "expert",
                               "allreduce[esp]", "a2a[ep]", "combine"]
    # under sequence parallelism every MP rank first collects all N tokens
    assert ops("baseline", True)[0] == "gather_tokens[mp]"
    assert ops("baseline", True)[-1] == "split_tokens[mp]"


def test_s1_pauses_mp_before_the_gate():
    # the exchange (AlltoAll, ESP gather, expert, ESP scatter, AlltoAll back) is one step, run
    # in --moe-parm-chunks pieces
    assert ops("s1") == ["split_tokens[mp]", "gate[mp]", "dispatch", "exchange[ep,esp]",
                         "combine", "gather_tokens[mp]"]
    # tokens already split: no MP split, and the output stays split
    assert ops("s1", True) == ops("s1")[1:-1]
    assert build_plan("s1", False).splits_tokens


def test_s2_pauses_mp_after_the_gate():
    # the exchange ends with the MP gather of the capacity slots (Parm's unified collective)
    assert ops("s2") == ["gate", "dispatch", "split_capacity[mp]", "exchange[ep,esp,mp]",
                         "combine"]
    assert build_plan("s2", False).splits_capacity


def test_unknown_schedule():
    with pytest.raises(ValueError, match="--moe-parm-schedule"):
        build_plan("s3", False)


def _layout(world, *argv):
    args = parse_args(["--num-experts", "4", "--disable-bias-linear", *argv], world_size=world)
    validate_layout(args)
    return args


def test_baseline_refuses_esp_other_than_mp():
    with pytest.raises(LayoutError, match="baseline.*--expert-tensor-parallel-size"):
        _layout(4, "--moe-parm-schedule", "baseline", "--tensor-model-parallel-size", "2",
                "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2")
    _layout(4, "--moe-parm-schedule", "s1", "--tensor-model-parallel-size", "2",
            "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2")


def test_s2_refuses_a_capacity_that_mp_does_not_divide():
    # 2 x 64 tokens, top-2, f = 1.0, 4 experts -> capacity 64, divisible by MP 2
    common = ["--moe-parm-schedule", "s2", "--tensor-model-parallel-size", "2",
              "--seq-length", "64", "--micro-batch-size", "2", "--moe-router-topk", "2"]
    _layout(2, *common, "--moe-expert-capacity-factor", "1.0")
    # f = 1.01 -> capacity ceil(64.64) = 65, which MP 2 cannot split in the padded exchange;
    # the exact one splits the 128 tokens instead
    with pytest.raises(LayoutError, match="capacity 65 .* not divisible by --tensor-model"):
        _layout(2, *common, "--moe-expert-capacity-factor", "1.01", "--moe-parm-exchange",
                "padded")
    _layout(2, *common, "--moe-expert-capacity-factor", "1.01")
    with pytest.raises(LayoutError, match="s2 splits the tokens over MP: 63 tokens"):
        _layout(2, "--moe-parm-schedule", "s2", "--tensor-model-parallel-size", "2",
                "--seq-length", "63", "--micro-batch-size", "1", "--num-attention-heads", "4")


def test_s1_without_sequence_parallel_needs_a_divisible_sequence():
    with pytest.raises(LayoutError, match="s1 splits tokens over MP"):
        _layout(2, "--moe-parm-schedule", "s1", "--tensor-model-parallel-size", "2",
                "--seq-length", "63", "--num-attention-heads", "4")


def test_megatron_schedule_keeps_megatrons_rule():
    with pytest.raises(LayoutError, match="needs --sequence-parallel"):
        _layout(2, "--moe-parm-schedule", "megatron", "--tensor-model-parallel-size", "2")
    _layout(2, "--moe-parm-schedule", "s2", "--tensor-model-parallel-size", "2")


def _auto(*argv):
    from parm_trainer.schedule.auto import resolve_auto_schedule

    args = parse_args(["--num-experts", "8", "--disable-bias-linear", "--moe-parm-schedule",
                       "auto", "--tensor-model-parallel-size", "4", "--hidden-size", "1024",
                       "--num-attention-heads", "8", "--seq-length", "1024",
                       "--expert-model-parallel-size", "2", *argv], world_size=8)
    said = []
    resolve_auto_schedule(args, log=said.append)
    return args.moe_parm_schedule, said[0]


A100 = str(ROOT / "tools" / "clusters" / "a100-nvlink-8x.json")
PADDED = ("--moe-parm-exchange", "padded", "--moe-parm-chunks", "1")


def test_auto_picks_by_the_cost_model_and_says_so():
    # the padded exchange, top-2 with capacity factor 1: S2's MP gather of k*f*N*M outweighs
    # S1's of N*M (dropless, s1's smaller gate calls pad more, which can tip it the other way:
    # test_cost_model.py)
    chosen, line = _auto("--moe-router-topk", "2", "--moe-expert-capacity-factor", "1.0",
                         "--moe-parm-cost-profile", A100, *PADDED)
    assert chosen == "s1" and "using s1" in line and A100 in line
    # top-1 with capacity factor 0.5: S2 gathers k*f*N*M = N*M/2, less than S1's N*M
    chosen, line = _auto("--moe-router-topk", "1", "--moe-router-pre-softmax",
                         "--moe-expert-capacity-factor", "0.5", "--moe-parm-cost-profile",
                         A100, *PADDED)
    assert chosen == "s2", line
    assert "s1 " in line and "s2 " in line  # both predictions are logged


def test_auto_chunks_pipeline_a_slow_link(tmp_path):
    """--moe-parm-chunks 0: the cost model picks the pipeline depth too. Nodes of 4 GPUs put
    the EP AlltoAll on a 1 GB/s link while the expert computes at 1 TFLOP/s, so overlapping
    them must win over r = 1; every (schedule, r) candidate is logged."""
    import json

    from parm_trainer.moe.cost_profile import KINDS

    path = tmp_path / "slow.json"
    path.write_text(json.dumps({
        "gpus_per_node": 4, "world_size": 8, "compute": {"alpha_us": 10, "TFLOPs": 1.0},
        "collectives": {k: {"intra": {"alpha_us": 10, "GBps": 100.0},
                            "inter": {"alpha_us": 30, "GBps": 1.0}} for k in KINDS}}))
    chosen, line = _auto("--moe-router-topk", "2", "--moe-parm-chunks", "0",
                         "--moe-parm-cost-profile", str(path))
    assert chosen in ("s1", "s2")
    assert "--moe-parm-schedule auto and --moe-parm-chunks 0" in line
    assert all(f"{n} r={r} " in line for n in ("s1", "s2") for r in (1, 2, 4, 8)), line
    # and, the exchange being exact and in one hop, depth 2 with the local rows first
    assert all(f"{n} r=2 local first " in line for n in ("s1", "s2")), line
    depth = int(line.rsplit("--moe-parm-chunks ", 1)[1].split()[0])
    assert depth > 1, line


def test_auto_without_a_profile_is_left_to_the_start_up_measurement():
    """No profile: nothing is decided before the process groups exist; the candidates are s1
    and s2 at depths 1, 2 and 4 by default (s1 alone with one MP rank, where s2 runs the same
    layer), only the depths of a schedule given, only the schedules at a depth given (tune.py
    measures them)."""
    from parm_trainer.schedule import tune
    from parm_trainer.schedule.auto import resolve_auto_schedule

    ep2, tp2 = ["--expert-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"]
    with_local = [("s1", r, local) for r, local in ((1, False), (2, False), (4, False),
                                                    (2, True))]
    for argv, want in (([], [("s1", r, False) for r in (1, 2, 4)]),
                       (tp2, [(n, r, False) for n in ("s1", "s2") for r in (1, 2, 4)]),
                       (["--moe-parm-schedule", "s2"], [("s2", r, False) for r in (1, 2, 4)]),
                       (["--moe-parm-chunks", "2"], [("s1", 2, False)]),
                       (tp2 + ["--moe-parm-chunks", "2"], [("s1", 2, False), ("s2", 2, False)]),
                       # with an EP group to send to: depth 2 with the local rows first too
                       (ep2, with_local),
                       (ep2 + ["--moe-parm-chunks", "2"], [("s1", 2, False)]),
                       (ep2 + ["--moe-parm-local-first"], [("s1", r, True) for r in (1, 2, 4)]),
                       (ep2 + ["--moe-parm-exchange", "padded"],
                        [("s1", r, False) for r in (1, 2, 4)])):
        args = parse_args(["--num-experts", "4", "--disable-bias-linear", *argv], world_size=2)
        said = []
        resolve_auto_schedule(args, log=said.append)
        assert args.moe_parm_tune_candidates == want and not said
        validate_layout(args)  # "auto" and depth 0 pass until they are resolved
        assert tune.runnable_candidates(args) == want  # each validated as it would run
    # relayed through nodes (EP 4 on 2 nodes of 2 ranks), the local rows are a node's: not
    # tried, and refused when asked for, as with no EP group or the padded exchange
    ep4 = ["--expert-model-parallel-size", "4", "--ranks-per-node", "2", "--moe-router-topk", "2"]
    args = parse_args(["--num-experts", "4", "--disable-bias-linear", *ep4], world_size=4)
    resolve_auto_schedule(args)
    assert all(not local for *_, local in args.moe_parm_tune_candidates)
    for world, argv in ((4, ep4), (2, []), (2, [*ep2, "--moe-parm-exchange", "padded"])):
        with pytest.raises(LayoutError, match="--moe-parm-local-first needs"):
            _layout(world, *argv, "--moe-parm-local-first")
    _layout(2, *ep2, "--moe-parm-local-first")
    args = parse_args(["--num-experts", "4", "--moe-parm-schedule", "megatron"], world_size=1)
    resolve_auto_schedule(args)
    assert args.moe_parm_chunks == 1 and not getattr(args, "moe_parm_tune_candidates", None)


def test_tune_cache_survives_a_corrupt_file(tmp_path):
    from parm_trainer.schedule import tune

    path = tmp_path / "sub" / "tune.json"
    assert tune.read_cached(str(path), "k") is None  # missing
    tune.write_cached(str(path), "k", {"choice": ["s1", 2, True],
                                 "measured_ms": {"s1 r=2 local first": 1.0}})
    assert tune.read_cached(str(path), "k")["choice"] == ["s1", 2, True]
    path.write_text("{not json")
    assert tune.read_cached(str(path), "k") is None
    tune.write_cached(str(path), "k2", {"choice": ["s2", 1, False], "measured_ms": {}})  # rewritten whole
    assert tune.read_cached(str(path), "k2")["choice"] == ["s2", 1, False]
    tune.write_cached(str(path), "k3", {"choice": ["s2", 1], "measured_ms": {}})  # an older entry
    assert tune.read_cached(str(path), "k3") is None
    assert not list(path.parent.glob("*.tmp*"))


def test_tune_cache_keeps_every_entry_of_jobs_writing_at_once(tmp_path):
    """Two jobs sharing one cache file (two runs on a machine, or the tests' two workers) each
    add their entries at the same moments: each read-modify-write of the file holds its lock,
    so none drops the other's entry; where both measured one layer, the first entry stays."""
    import multiprocessing

    from parm_trainer.schedule import tune

    path = str(tmp_path / "tune.json")

    def writer(name):
        for i in range(40):
            tune.write_cached(path, f"{name}{i}", {"choice": ["s1", 1, False], "measured_ms": {}})

    jobs = [multiprocessing.get_context("fork").Process(target=writer, args=(n,)) for n in "ab"]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()
    assert [job.exitcode for job in jobs] == [0, 0]
    missing = [f"{n}{i}" for n in "ab" for i in range(40) if tune.read_cached(path, f"{n}{i}") is None]
    assert not missing, missing
    # a job that measured a layer another job cached meanwhile gets (and uses) that one's entry
    theirs = tune.read_cached(path, "a0")
    mine = {"choice": ["s2", 4, False], "measured_ms": {"s2 r=4": 1.0}}
    assert tune.write_cached(path, "a0", mine) == theirs and tune.read_cached(path, "a0") == theirs
    assert tune.write_cached(path, "new", mine) is mine


def test_tune_times_the_candidates_in_interleaved_rounds():
    """A slow stretch of the machine (here the first 9 passes, 4 x slower) must not decide the
    choice: the candidates' true times are 3, 2, 4 and 5 ms; timed one candidate after the other
    (a warm-up and 3 passes each), a and b would have looked like 12 and 8 ms and c would have
    been taken; interleaved, each median is its true time. Every candidate gets its warm-up
    before any is timed; each round takes every candidate once, in an order of its own that
    depends on the round alone (every rank runs the same order)."""
    from parm_trainer.schedule.tune import interleaved_times

    def interleaved_medians(*args, **kwargs):
        return [statistics.median(t) for t in interleaved_times(*args, **kwargs).values()]

    true = {"a": 3e-3, "b": 2e-3, "c": 4e-3, "d": 5e-3}
    calls = []

    def run(candidate):
        calls.append(candidate)
        return true[candidate] * (4 if len(calls) <= 9 else 1)

    medians = interleaved_medians(list(true), run, warmup=1, rounds=5)
    assert medians == [3e-3, 2e-3, 4e-3, 5e-3]
    assert calls[:4] == ["a", "b", "c", "d"]  # the warm-ups
    rounds = [calls[4 + 4 * k: 8 + 4 * k] for k in range(5)]
    assert all(sorted(r) == ["a", "b", "c", "d"] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # not one order throughout
    # nor one cyclic order (a rotation): some candidate follows two different ones
    before = {(r[i], r[i - 1]) for r in rounds for i in range(1, 4)}
    assert any(len({b for c, b in before if c == x}) > 1 for x in true)
    calls.clear()
    assert interleaved_medians(list(true), run, warmup=1, rounds=5) == [3e-3, 2e-3, 4e-3, 5e-3]
    assert [calls[4 + 4 * k: 8 + 4 * k] for k in range(5)] == rounds
    assert len(calls) == 4 + 5 * 4


def test_tune_times_its_passes_with_the_collector_paused():
    """Every timed pass (and warm-up) runs with Python's automatic collector off: start-up's
    objects are not frozen yet, and a full collection's pause on one rank fell on whichever
    pass crossed the threshold. Afterwards the collector is as it was, on or off, even where
    a pass raised."""
    import gc

    from parm_trainer.schedule.tune import interleaved_times

    seen = []

    def run(candidate):
        seen.append(gc.isenabled())
        return 1.0

    assert gc.isenabled()
    try:
        interleaved_times(["a", "b"], run, warmup=1, rounds=2)
        assert seen == [False] * 6 and gc.isenabled()
        with pytest.raises(RuntimeError):
            interleaved_times(["a"], lambda c: (_ for _ in ()).throw(RuntimeError(c)))
        assert gc.isenabled()
        gc.disable()
        interleaved_times(["a"], run, warmup=0, rounds=1)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_tune_rounds_balance_what_each_candidate_follows():
    """Each round takes every candidate once, and over 2 n rounds of n candidates each one
    follows each other one exactly twice (a pass carries what the one before it left), for
    the candidate counts start-up measures (2 to 8); rounds 0-4 of three candidates are not
    all one order."""
    from collections import Counter

    from parm_trainer.schedule.tune import round_order

    for n in range(2, 9):
        items = [f"c{i}" for i in range(n)]
        rounds = [round_order(items, k) for k in range(2 * n)]
        assert all(sorted(r) == items for r in rounds)
        follows = Counter(pair for r in rounds for pair in zip(r, r[1:]))
        assert set(follows.values()) == {2} and len(follows) == n * (n - 1), (n, follows)
    assert len({tuple(round_order(["a", "b", "c"], k)) for k in range(5)}) == 5


def test_tune_runs_off_a_close_call():
    """Where the runner-up lies within 10 % of the fastest, the two alone get 6 more
    interleaved runs and the medians over all their runs decide: here b's 5 first runs are
    lucky (2.9 ms against a's 3.0) but its true time is 3.1 ms, so a is taken. The medians are
    reduced (as over ranks) before either comparison. c, 5 ms, is out of the race after two
    rounds (more than 25 % behind even at its fastest). A clear lead gets no run-off."""
    from parm_trainer.schedule.tune import measured_seconds

    calls, reduced = [], []

    def run(candidate):
        calls.append(candidate)
        lucky = candidate == "b" and calls.count("b") <= 6  # its warm-up and 5 rounds
        return {"a": 3.0, "b": 2.9 if lucky else 3.1, "c": 5.0}[candidate] * 1e-3

    def reduce(medians):
        reduced.append(list(medians))
        return medians

    seconds, run_off = measured_seconds(["a", "b", "c"], run, reduce)
    assert run_off == ("b", "a")
    assert min(seconds, key=seconds.get) == "a"
    assert seconds == pytest.approx({"a": 3.0e-3, "b": 3.1e-3, "c": 5.0e-3})
    # warm-ups, two rounds of all three, three more of a and b, the run-off's six
    assert len(calls) == 3 + 2 * 3 + 3 * 2 + 6 * 2 and set(calls[9:]) == {"a", "b"}
    assert calls.count("c") == 3
    assert reduced[0] == pytest.approx([3.0e-3, 2.9e-3, 5.0e-3]) and len(reduced) == 4

    calls.clear()
    seconds, run_off = measured_seconds(["a", "c"], run)
    assert len(calls) == 2 + 2 * 2 and run_off == ()  # c out after two rounds: a alone is left
    assert seconds == pytest.approx({"a": 3e-3, "c": 5e-3})


def test_tune_keeps_a_candidate_whose_slow_pass_was_a_spike():
    """Out of the race goes a candidate whose fastest pass is more than 25 % over the best
    median, not one a slow stretch of the machine hit: here b (as fast as a) has one pass at
    4 x in the first two rounds and runs all five; d, 1.3 x a on every pass, leaves after two."""
    from parm_trainer.schedule.tune import measured_seconds

    calls = []

    def run(candidate):
        calls.append(candidate)
        spike = 4 if candidate == "b" and calls.count("b") == 2 else 1
        return {"a": 2.0, "b": 2.05, "d": 2.6}[candidate] * spike * 1e-3

    seconds, run_off = measured_seconds(["a", "b", "d"], run)
    assert calls.count("d") == 1 + 2 and calls.count("b") == calls.count("a")
    assert calls.count("a") == 1 + 5 + 6 and run_off == ("a", "b")
    assert min(seconds, key=seconds.get) == "a"


def test_tune_cache_path(monkeypatch):
    from types import SimpleNamespace

    from parm_trainer.schedule.tune import cache_path

    monkeypatch.setenv("PARM_TRAINER_CACHE_DIR", "/somewhere")
    assert cache_path(SimpleNamespace(moe_parm_tune_cache=None)) == "/somewhere/moe_tune.json"
    assert cache_path(SimpleNamespace(moe_parm_tune_cache="x.json")) == "x.json"
    assert cache_path(SimpleNamespace(moe_parm_tune_cache="none")) is None
    monkeypatch.delenv("PARM_TRAINER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert cache_path(SimpleNamespace(moe_parm_tune_cache=None)) == \
        "/xdg/parm_trainer/moe_tune.json"


def test_pad_to_capacity_means_the_padded_exchange():
    args = parse_args(["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], world_size=1)
    assert args.moe_parm_exchange == "padded"
    assert parse_args(["--num-experts", "4"], world_size=1).moe_parm_exchange == "exact"
