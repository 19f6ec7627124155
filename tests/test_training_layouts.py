"""One model, many layouts: the same seed and global batch must give the same losses.

Weights are drawn layout-free (parm_trainer.models.init) and the sampler hands out the same
micro-batches for every data-parallel size, so 1 rank, TP2xEP2xESP2 on 4 ranks, TP2 with ESP1
and PP2 must agree to floating-point reordering. Each launch checks a whole layout at once.
"""

import json
import re

import pytest

from conftest import launch, max_relative, python, tiny_gpt_args
from parm_trainer import plots
from parm_trainer.moe import step_timing
from parm_trainer.moe.schedules import build_plan
from parm_trainer.training.checkpoint.files import TRACKER

TP2_EP2_ESP2_SP = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
                   "expert-tensor-parallel-size": 2, "sequence-parallel": True}
LAYOUTS = {
    # Parm's s1 and the others must train the same model identically (the default, auto, is
    # test_default_auto_measures_then_reads_its_cache)
    "tp2_ep2_esp2": (4, {**TP2_EP2_ESP2_SP, "moe-parm-schedule": "s1", "moe-parm-chunks": 1}),
    # gradients reduced in small buckets during the backward
    "tp2_ep2_esp2_s2": (4, {**TP2_EP2_ESP2_SP, "moe-parm-schedule": "s2",
                            "overlap-grad-reduce": True, "ddp-bucket-size": 4000}),
    # this EP rank's own rows computed apart, in two halves around the two-piece exchange
    "tp2_ep2_esp2_local_first": (4, {**TP2_EP2_ESP2_SP, "moe-parm-schedule": "s1",
                                     "moe-parm-chunks": 2, "moe-parm-local-first": True}),
    "tp2_ep2_esp2_baseline": (4, {**TP2_EP2_ESP2_SP, "moe-parm-schedule": "baseline"}),
    # EP 4 over 2 "nodes" of 2 ranks: the exact exchange relays (one link hop per node)
    "ep4_relayed": (4, {"expert-model-parallel-size": 4, "ranks-per-node": 2,
                        "moe-parm-schedule": "s2", "moe-parm-chunks": 2}),
    "tp2_ep2_esp2_megatron": (4, {**TP2_EP2_ESP2_SP, "moe-parm-schedule": "megatron"}),
    # without sequence parallelism s1 splits the replicated tokens itself; two-piece exchange;
    # every step timed (--timing-log-level 2 must not change what is computed), with the two
    # micro-batches taking turns (each timer counting its own micro-batch's time)
    "tp2_ep2_s1_no_sp_chunks2": (4, {"tensor-model-parallel-size": 2,
                                     "expert-model-parallel-size": 2, "moe-parm-chunks": 2,
                                     "moe-parm-schedule": "s1", "timing-log-level": 2,
                                     "overlap-moe-expert-parallel-comm": True}),
    # ESP differs from MP with EP=1: expert grads must be summed over the expert-DP group
    # ... and the distributed optimizer shards the experts' state over that group, the dense
    # state over DP (both in the memory estimate, checked against the probe)
    "tp2_esp1": (2, {"tensor-model-parallel-size": 2, "expert-tensor-parallel-size": 1,
                     "sequence-parallel": True, "use-distributed-optimizer": True,
                     "memory-probe": True}),
    # the stages chosen by the stage builder on its default path: the pieces measured at
    # start-up (schedule/layer_times.py), any split training the same model
    "pp2": (2, {"pipeline-model-parallel-size": 2, "timing-log-level": 2,
                "timing-log-option": "max", "pipeline-model-parallel-layout": "auto"}),
}


@pytest.fixture(scope="module")
def reference(gpt_data, tmp_path_factory):
    run = launch(1, tiny_gpt_args(gpt_data), tmp_path_factory.mktemp("ref"))
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_five_losses_match_single_rank(layout, reference, gpt_data, tmp_path):
    nproc, flags = LAYOUTS[layout]
    extra = {"tensorboard-dir": tmp_path / "tensorboard"} if "timing-log-level" in flags else {}
    auto = flags.get("pipeline-model-parallel-layout") == "auto"
    if auto:  # measured here, not read from the session's cache
        extra["moe-parm-tune-cache"] = tmp_path / "tune.json"
    run = launch(nproc, tiny_gpt_args(gpt_data, **flags, **extra), tmp_path)
    assert_trains_like(run, reference)
    if auto:
        check_measured_stages(run.output, tmp_path / "tune.json")
    if "memory-probe" in flags:
        assert_memory_as_estimated(run, stages=1)
    if "ranks-per-node" in flags:  # the relay ran: its in-node hop's groups were built
        assert "exchange relayed through 2 nodes of 2 EP ranks" in run.output
    if "overlap-moe-expert-parallel-comm" in flags:  # applied: no line saying otherwise
        assert "one micro-batch at a time here" not in run.output, run.output[-3000:]
    if "timing-log-level" in flags:
        check_timing_report(run.output, flags)
        check_plots(tmp_path, run)


def test_default_flags_train_alike_on_1_2_and_4_ranks(gpt_data, tmp_path):
    """No flag but the model's size and data (biases on, auto's schedule and depth measured at
    start-up): one rank once failed in the start-up measurement (megatron's expert MLP adds its
    bias in place to the output of a one-rank reduce; layer.expert_comm_explicit). It trains on
    1, 2 and 4 ranks (data-parallel) with the same losses, and with EP2 and a dense MLP."""
    fresh = {"PARM_TRAINER_CACHE_DIR": str(tmp_path / "cache")}  # measured here, not cached
    one = launch(1, tiny_gpt_args(gpt_data, **{"bias-linear": True}), tmp_path, env=fresh)
    assert "measured at start-up" in one.output, one.output[-3000:]
    for world in (2, 4):
        assert_trains_like(launch(world, tiny_gpt_args(gpt_data, **{"bias-linear": True}),
                                  tmp_path, env=fresh), one)
    flags = {"bias-linear": True, "moe-layer-freq": 2}  # a dense MLP (with its biases)
    ep2 = launch(2, tiny_gpt_args(gpt_data, **flags, **{"expert-model-parallel-size": 2}),
                 tmp_path)
    assert_trains_like(ep2, launch(1, tiny_gpt_args(gpt_data, **flags), tmp_path))


@pytest.fixture(scope="module")
def bf16_runs(gpt_data, tmp_path_factory):
    """bf16 on EP2 (LayerNorm, learned positions: megatron builds those weights in fp32), the
    experts as SequentialMLPs and in grouped GEMMs (megatron's GroupedMLP), each saving at
    iteration 3."""
    root = tmp_path_factory.mktemp("bf16")
    flags = {"bf16": True, "expert-model-parallel-size": 2, "moe-parm-schedule": "s1",
             "moe-parm-chunks": 1, "save-interval": 3}
    return root, {name: launch(2, tiny_gpt_args(gpt_data, **flags, **extra,
                                                save=root / name), root)
                  for name, extra in (("plain", {}), ("grouped", {"moe-grouped-gemm": True}))}


def test_grouped_gemm_trains_like_sequential_mlps(bf16_runs):
    _, runs = bf16_runs
    for name, experts in (("plain", "SequentialMLP"), ("grouped", "GroupedMLP")):
        assert runs[name].returncode == 0, runs[name].output[-4000:]
        assert f"experts {experts};" in runs[name].output
    plain, grouped = runs["plain"].loss(), runs["grouped"].loss()
    assert len(plain) == 5 and plain[-1] < plain[0]
    assert max_relative(grouped[:1], plain[:1]) < 1e-6  # same weights, same first step
    assert max_relative(grouped, plain) < 1e-3  # then bf16's rounding of different sums


@pytest.mark.parametrize("saved", ["grouped", "plain"])
def test_checkpoint_resumes_across_grouped_gemm(bf16_runs, gpt_data, saved):
    """Saved with grouped GEMMs, resumed without (and the other way): the same iterations
    4 and 5, optimizer state included (megatron keeps both in one checkpoint format)."""
    root, runs = bf16_runs
    at_3 = root / f"{saved}_at_3"
    at_3.mkdir()
    (at_3 / "iter_0000003").symlink_to(root / saved / "iter_0000003")
    (at_3 / TRACKER).write_text("3")
    flags = {"bf16": True, "expert-model-parallel-size": 2, "moe-parm-schedule": "s1",
             "moe-parm-chunks": 1, "moe-grouped-gemm": True if saved == "plain" else None,
             "load": at_3}
    run = launch(2, tiny_gpt_args(gpt_data, **flags), root)
    assert f"resumed from {at_3} at iteration 3" in run.output, run.output[-4000:]
    assert len(run.loss()) == 2
    assert max_relative(run.loss(), runs[saved].loss()[3:5]) < 1e-3


def assert_trains_like(run, reference, iterations=slice(0, 5)):
    """run's losses (those of `iterations` of the reference's five) are the reference's."""
    assert run.returncode == 0, run.output[-4000:]
    expected, got = reference.loss()[iterations], run.loss()
    assert len(reference.loss()) == 5 and len(got) == len(expected), (got, expected)
    assert max_relative(got, expected) < 1e-4, (got, expected)
    # the load-balancing loss is part of the same function
    assert max_relative(run.loss("load_balancing_loss"),
                        reference.loss("load_balancing_loss")[iterations]) < 1e-4
    # the routers sent every expert the same tokens (counts summed over the ranks)
    assert run.loss("tokens per expert") == reference.loss("tokens per expert")[iterations]
    assert len(re.findall(r"\| peak rss [\d.]+ MiB \(of it [\d.]+ since the model was built: "
                          r"estimate [\d.]+ MiB\)$",
                          run.output, re.M)) == len(expected)


def assert_memory_as_estimated(run, stages: int) -> None:
    """--memory-probe: each pipeline rank's parameter and gradient, optimizer and activation
    bytes, counted from the tensors (activations: saved_tensors_hooks, at their peak over the
    micro-batches in flight), against the start-up estimate: each part within 10 %, the total
    within 15 %."""
    lines = re.findall(r"^  PP rank (\d+): weights and gradients ([\d.]+) MiB, optimizer "
                       r"([\d.]+) MiB, activations ([\d.]+) MiB \(estimate ([\d.]+), ([\d.]+), "
                       r"([\d.]+)\)$", run.output, re.M)
    assert [int(rank) for rank, *_ in lines] == list(range(stages)), run.output[-4000:]
    for rank, *figures in lines:
        measured, estimated = [float(x) for x in figures[:3]], [float(x) for x in figures[3:]]
        for part, (m, e) in enumerate(zip(measured, estimated)):
            assert e == pytest.approx(m, rel=0.10), (rank, part, measured, estimated)
        assert sum(estimated) == pytest.approx(sum(measured), rel=0.15)


def check_plots(run_dir, run):
    """tools/plot_run.py on the run's folder: four PNGs, drawn from what the run logged."""
    result = python("tools/plot_run.py", run_dir, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    names = ("loss", "throughput", "expert_load", "step_times")
    assert result.stdout.splitlines() == [f"wrote {run_dir / 'plots' / n}.png" for n in names]
    for name in names:
        with open(run_dir / "plots" / f"{name}.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    scalars = plots.read_scalars(str(run_dir / "tensorboard"))
    assert [v for _, v in scalars["train/lm loss"]] == pytest.approx(run.loss(), rel=1e-6)
    # the heatmap's shares are the run's own counts per expert, normalised per layer
    load = plots.expert_load(scalars)
    assert sorted(load) == [1, 2]
    for layer, (steps, shares) in load.items():
        assert steps == [1, 2, 3, 4, 5]
        for counts, row in zip(run.loss("tokens per expert"), shares):
            want = counts[layer - 1]
            assert row == pytest.approx([c / sum(want) for c in want])
    iteration, moe = plots.step_breakdown(scalars)
    assert set(iteration) == set(plots.ITERATION_TIMERS) and sorted(moe) == [1, 2]


def check_measured_stages(output: str, cache) -> None:
    """--pipeline-model-parallel-layout auto with no profile: the pieces measured once the
    groups are up, cached, and the split they priced is the one the run built."""
    lines = output.splitlines()
    said = [line for line in lines if line.startswith("layer times for the stage builder")]
    assert len(said) == 1 and "(measured now in " in said[0] and f"cached in {cache})" in \
        said[0], output[-4000:]
    assert all(f" {kind} " in said[0] for kind in "EmL"), said[0]  # two MoE layers: no t
    (chosen,) = [line for line in lines
                 if line.startswith("--pipeline-model-parallel-layout auto: ")]
    layout = chosen.split()[2]
    assert "(predicted with layer times measured now in" in chosen, chosen
    assert f"pipeline layout {layout} (2 stages)" in lines, output[-4000:]
    assert lines.index(said[0]) < lines.index(chosen)


def check_timing_report(output: str, flags: dict) -> None:
    """--timing-log-level 2: after every logged iteration, megatron's level-1 and level-2
    timers and a line per MoE layer naming each plan step; a layer's steps run inside the
    iteration's forward-backward, so they cannot add up to more."""
    blocks = re.findall(r"^iteration .*\n((?:(?:\(min, max\) |max )?time across ranks.*\n"
                        r"|    .*\n)+)", output, re.M)
    assert len(blocks) == 5, output[-4000:]
    sp = bool(flags.get("sequence-parallel"))
    names = [flags["moe-parm-schedule"]] if "moe-parm-schedule" in flags else ["s1", "s2"]
    plans = {tuple(step_timing.labels(step.op for step in build_plan(name, sp).steps))
             for name in names}
    for block in blocks:
        times = {name: value for name, value in re.findall(
            r"^    ([a-z-]+) \.+: (.*)$", block, re.M)}
        for name in ("forward-backward", "forward-compute", "backward-compute",
                     "batch-generator", "all-grads-sync", "optimizer"):
            assert name in times, block
        most = {name: float(value.strip("()").split(", ")[-1]) for name, value in times.items()}
        least = {name: float(value.strip("()").split(", ")[0]) if value.startswith("(") else 0.0
                 for name, value in times.items()}  # (--timing-log-option max: no minimum)
        # on every rank forward + backward compute < forward-backward (micro-batches taking
        # turns: each its own time, none twice); the rank with the most of one has at least
        # the least of the other
        for one, other in (("forward-compute", "backward-compute"),
                           ("backward-compute", "forward-compute")):
            assert most[one] + least[other] < most["forward-backward"], block
        if flags.get("timing-log-option") == "max":
            assert block.startswith("max time across ranks (ms):"), block
            whole = float(times["forward-backward"])
        else:
            assert block.startswith("(min, max) time across ranks (ms):"), block
            whole = float(times["forward-backward"].strip("()").split(", ")[1])
        layers = re.findall(r"^    moe layer (\d) fwd/bwd \(ms, max over ranks\): (.*)"
                            r" \| total ([\d.]+)/([\d.]+)$", block, re.M)
        assert [int(layer) for layer, *_ in layers] == [1, 2], block  # both layers are MoE
        for _, steps, fwd, bwd in layers:
            assert tuple(part.split()[0] for part in steps.split(" | ")) in plans, steps
            if flags.get("expert-model-parallel-size", 1) > 1:  # the exchange's waits apart
                assert "exchange" in steps and "(wait " in steps, steps
            assert 0 < float(fwd) + float(bwd) < whole, block


def test_forked_launch_computes_what_torchrun_does(gpt_data, tmp_path):
    """The tests' launches (tests/torchrun_server.py: torchrun --run-path --start-method fork
    from a pre-imported process) against the real `python -m torch.distributed.run` on the
    same 2-rank run, dropout on: bit-equal losses, load-balancing losses and expert counts."""
    args = tiny_gpt_args(gpt_data, **{"expert-model-parallel-size": 2, "hidden-dropout": 0.1,
                                      "train-iters": 3})
    forked, real = launch(2, args, tmp_path), launch(2, args, tmp_path, real=True)
    for run in (forked, real):
        assert run.returncode == 0 and len(run.losses) == 3, run.output[-4000:]
    for key in ("lm loss", "load_balancing_loss", "tokens per expert"):
        assert forked.loss(key) == real.loss(key), key


def test_reference_learns(reference):
    """Guards the comparison above against a model that does nothing."""
    losses = reference.loss()
    assert losses[-1] < losses[0] - 0.01, losses
    # dropless top-2: each MoE layer assigns every token of the global batch (8 x 64) twice
    for table in reference.loss("tokens per expert"):
        assert [sum(row) for row in table] == [8 * 64 * 2] * 2, table


def test_default_auto_measures_then_reads_its_cache(reference, gpt_data, tmp_path):
    """No Parm flag: auto measures s1 and s2 at depths 1, 2 and 4 at start-up, caches the
    result, and a second run of the same layer on the same machine reads it; both train the
    reference's model."""
    cache = tmp_path / "tune.json"
    args = tiny_gpt_args(gpt_data, **TP2_EP2_ESP2_SP, **{"moe-parm-tune-cache": cache})
    first, second = (launch(4, args, tmp_path) for _ in range(2))
    for run in (first, second):
        assert run.returncode == 0, run.output[-4000:]
        assert max_relative(run.loss(), reference.loss()) < 1e-4
    said = [line for line in first.output.splitlines()
            if line.startswith("--moe-parm-schedule auto --moe-parm-chunks 0:")]
    assert len(said) == 1, first.output[-4000:]
    assert "measured at start-up in" in said[0] and f"cached in {cache}" in said[0]
    for candidate in ("s1 r=1", "s1 r=2", "s1 r=4", "s2 r=1", "s2 r=2", "s2 r=4",
                      "s1 r=2 local first", "s2 r=2 local first"):
        assert f"{candidate} " in said[0], said[0]
    table = json.loads(cache.read_text())
    (entry,) = table.values()
    name, chunks, local = entry["choice"]
    using = f"using {name} with --moe-parm-chunks {chunks}" + \
        (" --moe-parm-local-first" if local else "")
    assert said[0].endswith(using)
    label = f"{name} r={chunks}" + (" local first" if local else "")
    assert entry["measured_ms"][label] == min(entry["measured_ms"].values())
    # a close call between the two fastest is timed again (tune.measured_seconds)
    assert all(c in entry["measured_ms"] for c in entry["run_off"])
    assert not entry["run_off"] or f"{' and '.join(entry['run_off'])} within 10 %" in said[0]
    again = [line for line in second.output.splitlines()
             if line.startswith("--moe-parm-schedule auto --moe-parm-chunks 0:")]
    assert len(again) == 1 and f"(cached in {cache})" in again[0], second.output[-4000:]
    assert again[0].endswith(using)


# --- stages: uneven, dense layers between MoE layers, interleaved 1F1B -----------------------

SEVEN_LAYERS = {"num-layers": 7, "moe-layer-freq": 2}  # MoE layers 1, 3, 5, 7; dense between
INTERLEAVED = {"pipeline-model-parallel-size": 2, "use-distributed-optimizer": True,
               "pipeline-model-parallel-layout": "Ett|tt|tt|tL"}  # 2 chunks per rank
STAGES = {
    # megatron's uneven first stage: rank 0 holds layers 1-3, rank 1 layers 4-7
    "pp2_first_stage_3": (2, {"pipeline-model-parallel-size": 2,
                              "decoder-first-pipeline-num-layers": 3, "memory-probe": True}),
    # a layout string with repetition: the first stage holds the embedding and one layer
    "pp4_layout": (4, {"pipeline-model-parallel-size": 4,
                       "pipeline-model-parallel-layout": "Et|(tt|)*2,ttL", "memory-probe": True}),
}
STAGE_LINES = {
    "pp2_first_stage_3": ["pipeline layout Ettt|ttttL (2 stages)",
                          "  PP rank 0: embedding, layers 1-3 (MoE, dense, MoE)",
                          "  PP rank 1: layers 4-7 (dense, MoE, dense, MoE), loss"],
    "pp4_layout": ["pipeline layout Et|tt|tt|ttL (4 stages)",
                   "  PP rank 0: embedding, layer 1 (MoE)",
                   "  PP rank 1: layers 2-3 (dense, MoE)",
                   "  PP rank 2: layers 4-5 (dense, MoE)",
                   "  PP rank 3: layers 6-7 (dense, MoE), loss"],
}


@pytest.fixture(scope="module")
def seven_layer_reference(gpt_data, tmp_path_factory):
    run = launch(1, tiny_gpt_args(gpt_data, **SEVEN_LAYERS), tmp_path_factory.mktemp("ref7"))
    assert run.returncode == 0, run.output[-4000:]
    for table in run.loss("tokens per expert"):  # only the MoE layers route tokens
        assert [sum(row) > 0 for row in table] == [True, False] * 3 + [True], table
    return run


@pytest.mark.parametrize("stages", STAGES)
def test_uneven_stages_train_like_one_rank(stages, seven_layer_reference, gpt_data, tmp_path):
    nproc, flags = STAGES[stages]
    run = launch(nproc, tiny_gpt_args(gpt_data, **SEVEN_LAYERS, **flags), tmp_path)
    assert_trains_like(run, seven_layer_reference)
    assert_memory_as_estimated(run, stages=flags["pipeline-model-parallel-size"])
    lines = run.output.splitlines()
    start = lines.index(STAGE_LINES[stages][0])
    assert lines[start:start + len(STAGE_LINES[stages])] == STAGE_LINES[stages]


@pytest.fixture(scope="module")
def interleaved(gpt_data, tmp_path_factory):
    """2 virtual stages per rank under PP2, the distributed optimizer over both chunks, a save
    at iteration 3."""
    root = tmp_path_factory.mktemp("interleaved")
    args = tiny_gpt_args(gpt_data, **SEVEN_LAYERS, **INTERLEAVED,
                         **{"save": root / "ckpt", "save-interval": 3, "memory-probe": True})
    return root, launch(2, args, root)


def test_interleaved_schedule_trains_like_one_rank(interleaved, seven_layer_reference):
    _, run = interleaved
    assert_trains_like(run, seven_layer_reference)
    assert ("pipeline layout Ett|tt|tt|tL (2 stages x 2 virtual stages per rank, interleaved "
            "1F1B)") in run.output.splitlines()
    assert "  PP rank 0, virtual stage 1: layers 5-6 (MoE, dense)" in run.output.splitlines()
    assert_memory_as_estimated(run, stages=2)  # the chunks' peak over the interleaved schedule


def test_checkpoint_resumes_under_another_stage_layout(interleaved, seven_layer_reference,
                                                       gpt_data):
    """Saved with 2 chunks per rank, resumed with one, the first stage holding only the
    embedding (no MoE layer, no expert parameter: its distributed optimizer for the experts is
    empty): iterations 4 and 5 are the reference's; the layouts differ, so the RNG streams start
    afresh, saying why."""
    root, saved = interleaved
    assert saved.returncode == 0, saved.output[-4000:]
    at_3 = root / "at_3"  # the save of iteration 3 alone (the run saved 5 too)
    at_3.mkdir()
    (at_3 / "iter_0000003").symlink_to(root / "ckpt" / "iter_0000003")
    (at_3 / TRACKER).write_text("3")
    flags = {"pipeline-model-parallel-size": 2, "pipeline-model-parallel-layout": "E|t*7,L",
             "use-distributed-optimizer": True, "load": at_3}
    run = launch(2, tiny_gpt_args(gpt_data, **SEVEN_LAYERS, **flags), root)
    assert f"resumed from {at_3} at iteration 3" in run.output, run.output[-4000:]
    assert ("RNG streams not restored: the checkpoint was saved under TP1 PP2 DP1 EP1 ESP1 "
            "stages Ett|tt|tt|tL, this run is TP1 PP2 DP1 EP1 ESP1 stages E|tttttttL"
            ) in run.output
    assert_trains_like(run, seven_layer_reference, slice(3, 5))
