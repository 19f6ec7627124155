"""One MoE layer under every schedule and layout, against the single-process reference.

Three launches of tools/bench_moe_layer.py under torchrun (2, 4 and 8 gloo ranks), each running many
configurations in one go (its hidden --configs flag): every layout (MP, EP, ESP) that fits the
world, with and without --sequence-parallel where MP > 1, and for each the schedules baseline,
s1, s2 and megatron-core's MoELayer; the ones that cannot run a layout must be reported as
skipped with a reason. Dropless fp32 (and a few capacity-factor runs, where the reference
counts capacity per gate call as each schedule does): output, input grad, gate grad, expert
grads and the aux loss within 1e-5 of parm_trainer/moe/reference.py, whose values must dwarf
that tolerance; top-1 and top-2 also with --moe-router-pre-softmax (the softmax over all logits,
which top-1 needs). The 2-rank launch's MP=EP=ESP=1 layout is
two independent single-rank layers, megatron's own MoELayer included: it pins the reference's
routing, expert and aux-loss definitions (objective sum(out * grad) + coeff * aux) to megatron.
The 4-rank launch (sizes 1, 2 and 4) also runs the pipelined exchange (--moe-parm-chunks 2 and
4) on every layout, and
checks Parm's byte volumes at a fixed padded capacity against numbers computed here from the
formulas of PARM.md and comm.py, and the exact exchange's bytes (the default) per rank and
direction against the unique payload counted here from the routing of every rank's tokens.
Top-1 to top-4, dropless and with a capacity factor, run on the exact and the padded exchange.
It also runs every schedule in bf16 with the experts as SequentialMLP and in grouped GEMMs
(--moe-grouped-gemm: megatron's GroupedMLP), both within bf16's error of the reference.

    .venv/bin/python -m pytest tests/test_moe_layer.py -q
"""

from __future__ import annotations

import json
import pytest
import torch

from conftest import free_port, load_module, torchrun
from layer_bytes import check_exact_bytes, check_relay_bytes, expected_forward_bytes
from parm_trainer.bench import peers
from parm_trainer.moe import step_timing
from parm_trainer.moe.schedules import build_plan

TOL = 1e-5
SCHEDULES = ("baseline", "s1", "s2", "megatron")
DIFF_KEYS = ("output", "input_grad", "gate_grad", "expert_grad", "aux_loss")
SMALL = {"num-experts": 4, "moe-router-topk": 2, "hidden-size": 32, "moe-ffn-hidden-size": 64,
         "seq-length": 16, "micro-batch-size": 2, "moe-aux-loss-coeff": 0.1, "iters": 0,
         "warmup": 0, "schedules": ",".join(SCHEDULES)}


PRE_SOFTMAX = {"moe-router-topk": 1, "moe-router-pre-softmax": True}


def argv_of(flags: dict) -> list:
    out = []
    for key, value in flags.items():
        if value is False or value is None:
            continue
        out.append(f"--{key}")
        if value is not True:
            out.append(str(value))
    return out


def config(mp, ep, esp, sp=False, name=None, **extra):
    flags = {**SMALL, "tensor-model-parallel-size": mp, "expert-model-parallel-size": ep,
             "expert-tensor-parallel-size": esp, "sequence-parallel": sp, **extra}
    name = name or f"mp{mp}-ep{ep}-esp{esp}{'-sp' if sp else ''}"
    return {"name": name, "argv": argv_of(flags), "layout": (mp, ep, esp, sp), "flags": flags}


def layouts(world, sizes=(1, 2)):
    """Every (MP, EP, ESP) in sizes^3 that fits `world`, SP on and off where MP > 1."""
    out = []
    for mp in sizes:
        for ep in sizes:
            for esp in sizes:
                if world % mp or world % (ep * esp):
                    continue
                out.append(config(mp, ep, esp))
                if mp > 1:
                    out.append(config(mp, ep, esp, sp=True))
    return out


def run_launch(nproc, configs, tmp_path, timeout=240, dump=None):
    """tools/bench_moe_layer.py on nproc ranks (through conftest.torchrun, as a user's
    `torchrun --nproc-per-node N tools/bench_moe_layer.py ...`): {name: run}, its output."""
    cfg_file, out_file = tmp_path / f"configs{nproc}.json", tmp_path / f"out{nproc}.json"
    cfg_file.write_text(json.dumps([{"name": c["name"], "argv": c["argv"]} for c in configs]))
    argv = ["--nproc-per-node", nproc, "--master-port", free_port(), "tools/bench_moe_layer.py",
            "--configs", cfg_file, "--json", out_file]
    if dump:
        argv += ["--dump", dump]
    status, output = torchrun(argv, {"PARM_TRAINER_CACHE_DIR": str(tmp_path / "cache")},
                              timeout)  # auto measures afresh
    assert status == 0, output[-4000:]
    runs = json.loads(out_file.read_text())["runs"]
    assert [r["name"] for r in runs] == [c["name"] for c in configs]
    return {r["name"]: r for r in runs}, output


def same_groups_together(config_):
    """A sort key that puts the configurations of one set of process groups side by side (the
    sizes, and what decides the exact exchange's relay: bench/layout._layout_key): the launch
    rebuilds megatron's groups, tens of gloo groups on every rank, where the next one's
    differ."""
    flags = config_["flags"]
    return (config_["layout"][:3], flags.get("ranks-per-node", 0),
            flags["moe-router-topk"] > 1, flags.get("moe-parm-exchange", "exact"),
            bool(flags.get("moe-pad-expert-input-to-capacity")))


def should_run(schedule, mp, esp, sp):
    if schedule == "baseline":
        # ESP = MP (DeepSpeed's TED). planning/checks.validate_layout also admits MP = 1 with
        # ESP > 1, where the baseline's ESP all-reduce sums different DP replicas' tokens;
        # the bench tool skips that layout itself.
        return esp == mp
    if schedule.startswith("megatron"):
        return mp == 1 or sp
    return True


def groups_of(flags):
    """(num groups, group top-k) of a config's group-limited routing, or None."""
    if "moe-router-num-groups" not in flags:
        return None
    return flags["moe-router-num-groups"], flags["moe-router-group-topk"]


def check_correct(configs, runs):
    """Every schedule that can run the layout ran and matches the reference; the others are
    skipped with a reason. Returns the list of problems (empty when all is well)."""
    problems, checked = [], 0
    for c in configs:
        mp, ep, esp, sp = c["layout"]
        run = runs[c["name"]]
        extra = c["flags"].get("peers")
        wanted = peers.expand(c["flags"]["schedules"].split(",")
                              + (extra.split(",") if extra else []))
        assert list(run["schedules"]) == wanted, (c["name"], list(run["schedules"]))
        for schedule, result in run["schedules"].items():
            where = f"{c['name']}/{schedule}"
            if schedule.startswith("deepspeed") and result["status"] == "skipped" and \
                    "DeepSpeed is not installed" in result["reason"]:
                continue  # the optional extra .[peers]; make test does not install it
            if not should_run(schedule, mp, esp, sp):
                if result["status"] != "skipped" or not result.get("reason"):
                    problems.append(f"{where}: expected skipped with a reason, got {result}")
                continue
            if result["status"] != "ok":
                problems.append(f"{where}: {result}")
                continue
            beyond = run["config"].get("beyond_reference")
            if beyond and schedule.startswith("megatron"):
                continue  # the row the others are checked against (bench/features.py)
            if beyond and result.get("checked_against") != "megatron":
                problems.append(f"{where}: not checked against megatron's row: {result}")
            # DeepSpeed's rows and rows beyond the reference compare output and input grad
            for key in (DIFF_KEYS[:2] if schedule.startswith("deepspeed") or beyond
                        else DIFF_KEYS):
                diff = result["max_abs_diff"][key]
                if diff is None or not diff < TOL:
                    problems.append(f"{where}: {key} differs by {diff}")
                # The comparison means something: the reference values dwarf the tolerance.
                if result["reference_max_abs"][key] < 1e2 * TOL:
                    problems.append(f"{where}: reference {key} too small to test "
                                    f"({result['reference_max_abs'][key]})")
            checked += 1
    return problems, checked


# bf16 against the fp32 reference on the same (bf16) values: relative L2 error (gpu_smoke's)
BF16_TOL = {"output": 2e-2, "input_grad": 2e-2, "gate_grad": 5e-2, "expert_grad": 5e-2}


def check_grouped_gemm(plain, grouped):
    """--moe-grouped-gemm: every schedule's experts are megatron's GroupedMLP, as exact as
    SequentialMLP's in bf16; the errors are bf16's (not zero: bf16 ran) and the two agree."""
    assert list(grouped["schedules"]) == list(SCHEDULES)
    for schedule in SCHEDULES:
        a, b = plain["schedules"][schedule], grouped["schedules"][schedule]
        assert a["status"] == b["status"] == "ok", (schedule, a, b)
        assert (a["experts"], b["experts"]) == ("SequentialMLP", "GroupedMLP"), schedule
        for key, bound in BF16_TOL.items():
            assert 1e-5 < b["rel_l2_diff"][key] <= bound, (schedule, key, b["rel_l2_diff"])
            assert b["rel_l2_diff"][key] <= 1.5 * a["rel_l2_diff"][key] + 1e-3, \
                (schedule, key, a["rel_l2_diff"], b["rel_l2_diff"])


# --- 2 ranks ------------------------------------------------------------------------------

def test_two_ranks_every_layout_and_dump(tmp_path):
    configs = layouts(2)
    assert {c["layout"][:3] for c in configs} == {(1, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1),
                                                   (2, 1, 2), (2, 2, 1)}
    # --moe-router-pre-softmax (the softmax over all logits, taken at the top k): top-1, which
    # needs it, on megatron's own single-rank MoELayer and Parm's schedules, and top-2
    configs += [config(1, 1, 1, name="top1-pre-softmax", **PRE_SOFTMAX),
                config(1, 2, 1, name="top1-pre-softmax-ep2", **PRE_SOFTMAX),
                config(2, 1, 2, sp=True, name="top2-pre-softmax",
                       **{"moe-router-pre-softmax": True})]
    # --peers: its rows after --schedules', "deepspeed" for DeepSpeed's three modes (each
    # skipped with one line where DeepSpeed is not installed)
    configs.append(config(1, 2, 1, name="peers-flag",
                          **{"schedules": "s1", "peers": "megatron-alltoall,deepspeed"}))
    # a configuration no schedule can run is reported, table and all, and the launch goes on
    refused = config(1, 1, 1, name="top1-refused", **{"moe-router-topk": 1})
    dump = tmp_path / "dump"
    configs[0]["flags"]["iters"] = 1  # time one configuration (the rest only check)
    configs[0]["argv"] = argv_of(configs[0]["flags"])
    runs, stdout = run_launch(2, [*configs[:-1], refused, configs[-1]], tmp_path, dump=dump)
    problems, checked = check_correct(configs, runs)
    assert not problems, "\n".join(problems)
    assert checked >= 20
    for result in runs["top1-refused"]["schedules"].values():
        assert result["status"] == "skipped", result
        assert "--moe-router-topk 1 needs --moe-router-pre-softmax" in result["reason"]
    assert "skipped: --moe-router-topk 1 needs --moe-router-pre-softmax" in stdout

    # The single-rank layout: megatron's own MoELayer matches the reference.
    single = runs["mp1-ep1-esp1"]["schedules"]["megatron"]
    assert single["status"] == "ok" and single["aux_loss"] > 0
    assert runs["top1-pre-softmax"]["schedules"]["megatron"]["status"] == "ok"
    assert runs["top1-pre-softmax"]["config"]["router"].startswith("softmax over all logits")
    assert single["forward_ms"]["max"] > 0 and single["backward_ms"]["max"] > 0
    assert single["total_ms"]["max"] > 0
    # Skips appear in the printed table with their reason too.
    assert "skipped: --moe-parm-schedule baseline" in stdout
    assert list(runs["peers-flag"]["schedules"]) == ["s1", "megatron-alltoall", *peers.DEEPSPEED]
    assert "skipped: MoE with --tensor-model-parallel-size > 1" in stdout

    # The dump of the first configuration (DP replica 0) reproduces with reference.py here.
    from parm_trainer.moe.reference import moe_reference

    d = dump / configs[0]["name"]
    x, g = torch.load(d / "input.pt"), torch.load(d / "output_grad.pt")
    w = torch.load(d / "weights.pt")
    assert x.shape == (16 * 2, 32) and w["fc1"].shape == (4, 64, 32)
    assert w["fc2"].shape == (4, 32, 64) and w["gate"].shape == (4, 32)
    assert w["activation"] == "gelu" and "top-k" in w["router"]
    x = x.clone().requires_grad_()
    ref = moe_reference(x, w["gate"], w["fc1"], w["fc2"], topk=2, aux_loss_coeff=0.1)
    ((ref.output * g).sum() + ref.aux_loss).backward()
    for schedule in SCHEDULES:
        out = torch.load(d / f"{schedule}_output.pt")
        in_grad = torch.load(d / f"{schedule}_input_grad.pt")
        assert (out - ref.output).abs().max() < TOL, schedule
        assert (in_grad - x.grad).abs().max() < TOL, schedule


# --- 4 ranks ------------------------------------------------------------------------------

BYTES_FLAGS = {"seq-length": 64, "micro-batch-size": 2, "hidden-size": 64,
               "moe-ffn-hidden-size": 128, "moe-expert-capacity-factor": 1.0,
               "moe-pad-expert-input-to-capacity": True}


def group_flags(groups, group_topk):
    return {"moe-router-score-function": "sigmoid", "moe-router-num-groups": groups,
            "moe-router-group-topk": group_topk}


EXACT_BYTES = {"exact-bytes-sp": ((2, 2, 2, True), {"moe-parm-chunks": 2}),
               "exact-bytes-ep4": ((1, 4, 1, False), {"moe-router-topk": 3, "num-experts": 8,
                                                      "moe-parm-chunks": 4}),
               # this EP rank's own rows computed apart: the same bytes on the wire
               "exact-bytes-local": ((2, 2, 2, True), {"schedules": "s1/r2/local,s2/r1/local"}),
               # group-limited routing (sigmoid scores, 4 groups, 2 per token): rows checked
               # against megatron's layer, bytes against the routing counted in layer_bytes
               "exact-bytes-groups": ((1, 4, 1, False), {
                   "moe-router-topk": 4, "num-experts": 8, "moe-parm-chunks": 2,
                   "schedules": "s1,s2,megatron", **group_flags(4, 2)})}


RELAY_BYTES = {"relay-bytes": ((1, 4, 1, False), {"moe-router-topk": 3, "num-experts": 8,
                                                  "moe-parm-chunks": 2, "ranks-per-node": 2}),
               # node-limited (a group per node, one per token): each token crosses to one
               "relay-bytes-groups": ((1, 4, 1, False), {
                   "moe-router-topk": 3, "num-experts": 8, "moe-parm-chunks": 2,
                   "ranks-per-node": 2, "schedules": "s1,s2,megatron", **group_flags(2, 1)})}


def test_four_ranks_every_layout_chunks_and_bytes(tmp_path):
    configs = layouts(4, sizes=(1, 2, 4))
    two = {c["layout"][:3] for c in configs if max(c["layout"][:3]) <= 2}
    assert len(two) == 8  # every MP, EP, ESP in {1, 2}; and the layouts with a 4 that fit
    # The pipelined exchange (r = 2 and 4) on every layout with something to pipeline.
    configs += [config(*c["layout"], name=f"{c['name']}-chunks{r}",
                       **{"moe-parm-chunks": r, "schedules": "s1,s2"})
                for c in list(configs) if max(c["layout"][:3]) > 1 for r in (2, 4)]
    configs += [
        config(2, 2, 1, sp=True, name="megatron-allgather",
               **{"moe-token-dispatcher-type": "allgather", "schedules": "megatron"}),
        # the peers by name, auto with the pipeline depth left to the cost model, and rows
        # at a depth of their own (s1/r2, s2/r4), all in one interleaved timing
        config(2, 2, 2, sp=True, name="peers-auto",
               **{"moe-parm-chunks": 0, "schedules": "auto,s1/r2,s2/r4,megatron-alltoall,"
                                                     "megatron-allgather,deepspeed-ted"}),
        # Token dropping: capacity counted per gate call, as the reference does for each.
        config(2, 2, 2, name="drop", **{"moe-expert-capacity-factor": 1.0}),
        # top-1 (pre-softmax), dropless and dropping by its probabilities, pipelined
        config(2, 2, 2, sp=True, name="top1", **PRE_SOFTMAX),
        config(2, 2, 2, name="top1-drop",
               **{**PRE_SOFTMAX, "moe-expert-capacity-factor": 1.0, "moe-parm-chunks": 2}),
        config(2, 2, 2, sp=True, name="drop-sp", **{"moe-expert-capacity-factor": 1.0}),
        config(2, 2, 2, name="bytes", **BYTES_FLAGS, iters=1),
        config(2, 2, 2, sp=True, name="bytes-sp", **BYTES_FLAGS),
        config(2, 2, 2, name="bytes-chunks2",
               **{**BYTES_FLAGS, "moe-parm-chunks": 2, "schedules": "s1,s2"}),
        # top-3 and top-4, dropless and dropping, exact and padded, pipelined
        config(2, 2, 2, sp=True, name="top3-chunks4",
               **{"moe-router-topk": 3, "moe-parm-chunks": 4, "schedules": "s1,s2"}),
        config(2, 2, 2, name="top4-drop-chunks2",
               **{"moe-router-topk": 4, "moe-expert-capacity-factor": 1.0, "moe-parm-chunks": 2}),
        config(1, 4, 1, name="top3-ep4-drop",
               **{"moe-router-topk": 3, "num-experts": 8, "moe-expert-capacity-factor": 1.5}),
        *[config(*layout, name=f"padded-{name}",
                 **{"moe-parm-exchange": "padded", "moe-parm-chunks": r, "schedules": "s1,s2",
                    **extra})
          for layout, name, r, extra in (((2, 2, 2, True), "sp-chunks2", 2, {}),
                                         ((2, 2, 2, False), "drop", 1,
                                          {"moe-expert-capacity-factor": 1.0}),
                                         ((1, 4, 1, False), "top3-chunks4", 4,
                                          {"moe-router-topk": 3}))],
        # this EP rank's own rows computed apart (--moe-parm-local-first), top-1 to top-4,
        # dropless and dropping, at depths 1, 2 and 4
        *[config(2, 2, 2, sp=sp, name=f"local-first-top{k}{'-drop' if f else ''}",
                 **{"moe-router-topk": k, "moe-expert-capacity-factor": f,
                    "schedules": "s1/r1/local,s1/r2/local,s2/r1/local,s2/r4/local",
                    **(PRE_SOFTMAX if k == 1 else {})})
          for k, f, sp in ((1, 1.0, False), (2, None, True), (3, None, True), (4, 1.0, False))],
        # the exact exchange's bytes against the routing (EXACT_BYTES)
        *[config(*layout, name=name, **{"schedules": "s1,s2", **extra})
          for name, (layout, extra) in EXACT_BYTES.items()],
        # relayed through 2 "nodes" of 2 ranks (--ranks-per-node 2): every EP4 token once
        # per node over the link; top-2 dropping, top-4 pipelined, and the relay's bytes
        *[config(1, 4, 1, name=f"relay-{name}",
                 **{"num-experts": 8, "ranks-per-node": 2, "schedules": "s1,s2", **extra})
          for name, extra in (("top2-drop-r1", {"moe-expert-capacity-factor": 1.0,
                                                 "moe-parm-chunks": 1}),
                              ("top4-chunks4", {"moe-router-topk": 4, "moe-parm-chunks": 4}))],
        *[config(*layout, name=name, **{"schedules": "s1,s2", **extra})
          for name, (layout, extra) in RELAY_BYTES.items()],
        # every plan step timed as --timing-log-level 2 times it in training
        config(2, 2, 2, sp=True, name="step-times",
               **{"step-times": True, "moe-parm-chunks": 2, "schedules": "s1,s2,megatron",
                  "iters": 3}),
    ]
    # bf16, each rank's experts as megatron's SequentialMLP and in grouped GEMMs (GroupedMLP)
    grouped = [config(2, 2, 2, sp=True, name=f"bf16{suffix}",
                      **{"bf16": True, "moe-grouped-gemm": bool(suffix), "moe-parm-chunks": 2})
               for suffix in ("", "-grouped-gemm")]
    runs, stdout = run_launch(4, sorted(configs + grouped, key=same_groups_together), tmp_path,
                              dump=tmp_path / "dump")
    check_step_times(runs["step-times"], stdout)
    problems, checked = check_correct(configs, runs)
    assert not problems, "\n".join(problems)
    assert checked >= 80
    check_grouped_gemm(runs["bf16"], runs["bf16-grouped-gemm"])

    n, m, e, k, f = 64 * 2, 64, 4, 2, 1.0
    for name, sp in (("bytes", False), ("bytes-sp", True)):
        schedules = runs[name]["schedules"]
        assert schedules["megatron"].get("bytes") is None
        if not sp:
            assert schedules["megatron"]["status"] == "skipped"
        a2a = {}
        for schedule in ("baseline", "s1", "s2"):
            want, cap, cap_s1 = expected_forward_bytes(schedule, 2, 2, 2, sp, n, m, e, k, f)
            assert cap_s1 * 2 == cap == 64  # C divides evenly: C_s1 = C / G exactly
            got = schedules[schedule]["bytes"]
            for kind in ("alltoall", "allgather", "reducescatter", "allreduce"):
                assert got["forward"][kind] == [want.get(kind, 0)] * 4, (name, schedule, kind)
            # The backward AlltoAlls mirror the forward ones.
            assert got["backward"]["alltoall"] == got["forward"]["alltoall"], (name, schedule)
            a2a[schedule] = got["forward"]["alltoall"]
        mp_groups = ([0, 1], [2, 3])  # megatron's rank order: MP is the innermost dimension
        for group in mp_groups:
            base = sum(a2a["baseline"][r] for r in group)
            # two AlltoAlls of (E, C, M) fp32, each sending half of it, on each of 2 ranks
            assert base == 2 * (2 * (e * 64 * m * 4) // 2)
            for schedule in ("s1", "s2"):
                assert 2 * sum(a2a[schedule][r] for r in group) == base, (name, schedule)
    for name, (layout, extra) in EXACT_BYTES.items():
        check_exact_bytes(runs[name], tmp_path / "dump" / name, *layout[:3],
                          topk=extra.get("moe-router-topk", 2),
                          schedules=[s for s in extra.get("schedules", "s1,s2").split(",")
                                     if s != "megatron"], groups=groups_of(extra))
    for name, (layout, extra) in RELAY_BYTES.items():
        check_relay_bytes(runs[name], tmp_path / "dump" / name, *layout[:3],
                          topk=extra["moe-router-topk"], per_node=extra["ranks-per-node"],
                          groups=groups_of(extra))
    auto = runs["peers-auto"]["schedules"]["auto"]
    # no cost profile: measured on this layout as a training run does at start-up
    assert auto["auto_choice"].startswith("--moe-parm-schedule auto --moe-parm-chunks 0:")
    assert "measured at start-up" in auto["auto_choice"]
    assert auto["plan"].split(":")[0] in ("s1", "s2") and auto["chunks"] in (1, 2, 4, 8)
    assert [runs["peers-auto"]["schedules"][p]["plan"] for p in ("megatron-alltoall",
            "megatron-allgather")] == [f"megatron-core MoELayer ({d} dispatcher)"
                                       for d in ("alltoall", "allgather")]
    for row, chunks in (("s1/r2", 2), ("s2/r4", 4)):
        result = runs["peers-auto"]["schedules"][row]
        assert result["chunks"] == chunks and result["plan"].startswith(row[:2] + ":"), result
        assert result["auto_choice"] is None
        assert (tmp_path / "dump" / "peers-auto" / f"{row.replace('/', '-')}_output.pt").exists()
    # The pipelined exchange moves the same bytes.
    for schedule in ("s1", "s2"):
        chunked = runs["bytes-chunks2"]["schedules"][schedule]["bytes"]
        assert chunked == runs["bytes"]["schedules"][schedule]["bytes"], schedule
    timed = runs["bytes"]["schedules"]
    for schedule in ("baseline", "s1", "s2"):
        assert timed[schedule]["forward_ms"]["rank0"] > 0
        assert timed[schedule]["fwd_bwd_ratio"] > 0
    assert timed["baseline"]["fwd_bwd_ratio"] == pytest.approx(1.0)


def check_step_times(run, stdout):
    """--step-times: every plan step of s1 and s2 timed forward and backward, the exchange's
    waits apart; each iteration's steps lie inside its forward and its backward, so on every
    rank their sums stay below those (1 us of clock rounding)."""
    schedules = run["schedules"]
    assert "step_ms" not in schedules["megatron"]
    for name in ("s1", "s2"):
        timing = schedules[name]["step_ms"]
        labels = step_timing.labels(step.op for step in build_plan(name, True).steps)
        assert {key.rsplit("-", 1)[0] for key in timing["steps_max"]
                if not key.endswith("-wait")} == set(labels), timing["steps_max"]
        assert timing["steps_max"]["exchange-fwd-wait"] > 0
        assert timing["steps_max"]["exchange-bwd-wait"] > 0
        for rank in timing["per_rank"]:
            assert len(rank["fwd"]) == 3  # --iters
            for steps, whole in (("fwd_steps", "fwd"), ("bwd_steps", "bwd")):
                for inside, outside in zip(rank[steps], rank[whole]):
                    assert 0 < inside <= outside + 1e-3, (name, steps, rank)
        assert 0 < timing["steps_total"] <= timing["fwd_bwd_total"] + 1e-3
        assert f"{name} steps sum " in stdout and f"{name} steps fwd/bwd ms: " in stdout


# --- 8 ranks ------------------------------------------------------------------------------

def test_eight_ranks(tmp_path):
    configs = [config(4, 2, 4), config(4, 2, 4, sp=True), config(2, 2, 2), config(2, 2, 2, sp=True),
               config(2, 4, 2), config(2, 4, 2, sp=True),
               config(4, 2, 4, name="mp4-chunks3-sp", sp=True,
                      **{"moe-parm-chunks": 3, "schedules": "s1,s2"})]
    # the exact exchange at depths 1, 2 and 4, top-1 to top-4, dropless and dropping
    configs += [config(2, 4, 2, sp=True, name=f"top{k}-r{r}{'-drop' if f else ''}",
                       **{"num-experts": 8, "moe-router-topk": k, "moe-parm-chunks": r,
                          "moe-expert-capacity-factor": f, "schedules": "s1,s2",
                          **(PRE_SOFTMAX if k == 1 else {})})
                for k, r, f in ((1, 4, None), (2, 2, 1.0), (3, 1, None), (4, 4, 1.25),
                                (4, 2, None))]
    # relayed with ESP 2 and SP: EP groups {0, 2, 4, 6} and {1, 3, 5, 7} on 2 "nodes" of 4
    # ranks (dropping is relayed on 4 ranks)
    configs.append(config(2, 4, 2, sp=True, name="local-first-top3",
                          **{"num-experts": 8, "moe-router-topk": 3,
                             "schedules": "s1/r2/local,s2/r1/local"}))
    configs.append(config(2, 4, 2, sp=True, name="relay-top3-r2-sp",
                          **{"num-experts": 8, "moe-router-topk": 3, "moe-parm-chunks": 2,
                             "ranks-per-node": 4, "schedules": "s1,s2"}))
    runs, _ = run_launch(8, configs, tmp_path, timeout=300, dump=tmp_path / "dump")
    problems, checked = check_correct(configs, runs)
    assert not problems, "\n".join(problems)
    assert checked >= 30
    check_relay_bytes(runs["relay-top3-r2-sp"], tmp_path / "dump" / "relay-top3-r2-sp", 2, 4, 2,
                      topk=3, per_node=4, world=8)
    assert runs["mp2-ep2-esp2"]["config"]["data_parallel_size"] == 4


def test_help_states_router_and_activation(capsys):
    tool = load_module("tools/bench_moe_layer.py", "bench_moe_layer")
    with pytest.raises(SystemExit) as done:
        tool.main(["--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert "softmax over the top-k logits" in shown
    assert "gelu" in shown
