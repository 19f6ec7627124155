"""validate_cost_model without launches (parm_trainer/bench/validation.py, cost_fit.py,
validation_report.py; the tool's flags): the layer-term fit recovers known terms and keeps them
non-negative, rounds are averaged, and scoring on a synthetic bench result made from known
terms gives zero error and the right choices. Single process.
"""

import importlib.util
import json
from dataclasses import replace

import numpy as np
import pytest

from conftest import ROOT
from parm_trainer.bench import validation
from parm_trainer.bench.cost_fit import _nnls, layer_shape, parts
from parm_trainer.bench.validation_report import format_report, write_png
from parm_trainer.moe.cost_model import calls, plan_cost, step_load, walk
from parm_trainer.moe.cost_profile import DEFAULT_PROFILE, LAYER_DEFAULT, LAYER_KEYS
from parm_trainer.moe.cost_shape import remote_share
from parm_trainer.moe.schedules import build_plan

spec = importlib.util.spec_from_file_location("validate_cost_model",
                                              ROOT / "tools/validate_cost_model.py")
command = importlib.util.module_from_spec(spec)
spec.loader.exec_module(command)


def test_nnls_matches_least_squares_and_clips_negative_terms():
    rng = np.random.default_rng(0)
    a = rng.uniform(0.1, 1.0, size=(20, 3))
    x = np.array([2.0, 0.5, 0.3])
    assert _nnls(a, a @ x) == pytest.approx(x, rel=1e-9)
    # a target that wants a negative third term: that term is held at 0
    b = a @ np.array([1.0, 1.0, -0.5])
    got = _nnls(a, b)
    assert got[2] == 0.0 and (got >= 0).all()
    free = np.linalg.lstsq(a[:, :2], b, rcond=None)[0]
    assert got[:2] == pytest.approx(free, rel=1e-9)


def test_grid_has_held_out_configurations_on_many_layouts():
    configs = validation.grid()
    assert len(configs) >= 32
    assert len({layout for layout, _ in configs}) == len(validation.LAYOUTS)
    assert all(layout[0] >= 2 for layout, _ in configs)  # MP 1 leaves nothing to choose
    # on nodes of 2 ranks (--nodes): only layouts whose MP groups stay inside a node, each met
    node = validation.grid(validation.node_layouts(2))
    assert len(node) == len(configs) and {layout[0] for layout, _ in node} == {2}
    assert len({layout for layout, _ in node}) == len(validation.node_layouts(2)) >= 4


def _config(layout, shape, chunks=1):
    (mp, ep, esp, sp), (seq, mbs, hidden, ffn, experts, topk, factor) = layout, shape
    return {"tokens_per_mp_group": seq * mbs, "hidden_size": hidden,
            "moe_ffn_hidden_size": ffn, "num_experts": experts, "moe_router_topk": topk,
            "moe_expert_capacity_factor": factor, "tensor_model_parallel_size": mp,
            "expert_model_parallel_size": ep, "expert_tensor_parallel_size": esp,
            "sequence_parallel": sp, "moe_parm_chunks": chunks}


def _synthetic_runs(terms, chunks=(), profile=DEFAULT_PROFILE):
    """bench_moe_layer-like runs whose times are exactly the model's with `terms`: every
    configuration unpipelined ("c03"), and s1 and s2 at each of `chunks` ("c03r4")."""
    truth = replace(profile, layer=terms)
    runs = []
    for i, (layout, shape) in enumerate(validation.grid()[:12]):
        for r in (1, *chunks):
            runs.append(_synthetic_run(f"c{i:02d}" + (f"r{r}" if r > 1 else ""),
                                       _config(layout, shape, r), truth))
    return runs


def _synthetic_run(name, config, truth):
    shape_ = layer_shape(config)
    schedules = {}
    for name_ in validation.SCHEDULES if config["moe_parm_chunks"] == 1 else validation.PIPELINED:
        try:
            seconds = plan_cost(build_plan(name_, config["sequence_parallel"]), shape_,
                                truth)["total_s"]
        except ValueError as error:
            schedules[name_] = {"status": "skipped", "reason": str(error)}
            continue
        schedules[name_] = {"status": "ok", "forward_ms": {"max": seconds * 1e3 / 3},
                            "backward_ms": {"max": seconds * 1e3 * 2 / 3},
                            "total_ms": {"max": seconds * 1e3}}
    return {"name": name, "config": config, "schedules": schedules}


def test_evaluate_recovers_the_terms_behind_synthetic_measurements(tmp_path):
    terms = (2.0, 1.5, 2e-4, 5e-4)
    runs = _synthetic_runs(terms)
    result = validation.evaluate(runs, DEFAULT_PROFILE)
    summary = result["summary"]
    for fitted in (summary["layer_terms"], *summary["fold_layer_terms"]):
        assert [fitted[k] for k in LAYER_KEYS] == pytest.approx(terms, rel=1e-6)
    assert result["profile"].layer == pytest.approx(terms, rel=1e-6)
    assert len(summary["fold_layer_terms"]) == summary["folds"] == validation.FOLDS == 2
    assert summary["median_abs_rel_error"] == pytest.approx(0.0, abs=1e-9)
    # every configuration is held out once, in the order measured
    assert [row["name"] for row in result["configs"]] == [run["name"] for run in runs]
    assert summary["held_out_runs"] == 12
    assert summary["auto_right_all"] == 12  # exact times: auto is always right
    assert "median |predicted - measured|" in format_report(result)
    png = write_png(result, str(tmp_path / "v.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_folds_split_every_repeated_layout():
    for g in (validation.grid(), validation.grid(validation.node_layouts(2), validation.NODE_SHAPES, 2),
              validation.grid(validation.node_layouts(4, 8), validation.NODE_SHAPES, 2)):
        runs = [{"name": f"c{i:02d}", "config": _config(*c)} for i, c in enumerate(g)]
        runs += [{"name": f"c{i:02d}r4", "config": _config(*c, 4)} for i, c in enumerate(g)]
        layouts = [layout for layout, _ in g]
        repeated = {layout for layout in layouts if layouts.count(layout) > 1}
        for seed in range(5):  # in any order the runs come
            order = np.random.default_rng(seed).permutation(len(runs))
            folds = validation.deal([runs[i] for i in order])
            assert len(folds) == validation.FOLDS and set.union(*folds) == {
                r["name"] for r in runs[:len(g)]}
            assert sum(map(len, folds)) == len(g)  # each configuration in one fold
            for held in folds:
                assert repeated <= {layout for i, layout in enumerate(layouts)
                                    if f"c{i:02d}" not in held}


def test_each_fold_is_predicted_by_the_terms_fitted_on_the_other():
    # one fold's configurations measured with one set of terms, the other's with another:
    # each fold's terms are the other fold's, and its rows are priced with them
    first, second = (2.0, 1.5, 2e-4, 5e-4), (0.5, 3.0, 1e-4, 2e-3)
    held = validation.deal(_synthetic_runs(first))[0]
    runs = [a if a["name"] in held else b
            for a, b in zip(_synthetic_runs(first), _synthetic_runs(second))]
    result = validation.evaluate(runs, DEFAULT_PROFILE)
    folds = result["summary"]["fold_layer_terms"]
    assert [folds[0][k] for k in LAYER_KEYS] == pytest.approx(second, rel=1e-6)
    assert [folds[1][k] for k in LAYER_KEYS] == pytest.approx(first, rel=1e-6)
    for row in result["configs"]:
        terms = second if row["name"] in held else first
        for name, s in row["schedules"].items():
            if s["measured_s"] is not None:
                shape = layer_shape(row["config"])
                assert s["predicted_s"] == pytest.approx(plan_cost(
                    build_plan(name, shape.sequence_parallel), shape,
                    replace(DEFAULT_PROFILE, layer=terms))["total_s"], rel=1e-6)
    assert result["summary"]["median_abs_rel_error"] > 0.05  # the halves disagree
    with pytest.raises(ValueError, match="configurations for 2 folds"):
        validation.evaluate(runs[:1], DEFAULT_PROFILE)


def test_rounds_are_averaged(tmp_path):
    runs = _synthetic_runs(LAYER_DEFAULT)[:2]
    paths = []
    for factor in (1.0, 3.0):
        scaled = json.loads(json.dumps(runs))
        for run in scaled:
            for r in run["schedules"].values():
                if r["status"] == "ok":
                    for key in ("forward_ms", "backward_ms", "total_ms"):
                        r[key]["max"] *= factor
        paths.append(tmp_path / f"bench_{factor}.json")
        paths[-1].write_text(json.dumps({"runs": scaled[::-1] if factor > 1 else scaled}))
    merged = validation.merge_rounds([str(p) for p in paths])
    assert [run["name"] for run in merged] == [run["name"] for run in runs]
    for got, want in zip(merged, runs):
        for name, r in want["schedules"].items():
            if r["status"] == "ok":
                assert validation.measured_s(got["schedules"][name]) == \
                    pytest.approx(2.0 * validation.measured_s(r))


def test_parts_are_the_gradient_of_the_prediction_in_the_layer_terms():
    # unpipelined: the isolated collective and compute seconds, 3 x steps and the calls,
    # computed here from plan_cost on profiles with the collectives or the compute removed
    config = _config((2, 2, 2, True), (128, 4, 256, 512, 4, 2, None))
    shape = layer_shape(config)
    no_comm = replace(DEFAULT_PROFILE, collectives={
        k: {link: (0.0, 1e-30) for link in v} for k, v in DEFAULT_PROFILE.collectives.items()})
    plan = build_plan("s2", True)
    total, compute = (plan_cost(plan, shape, p)["total_s"] for p in (DEFAULT_PROFILE, no_comm))
    n_calls = sum(calls(load.forward, load) + calls(load.backward, load)
                  for load in (step_load(st, shape, held)[0] for st, held in walk(plan, shape)))
    assert parts("s2", shape, DEFAULT_PROFILE) == pytest.approx(
        [total - compute, compute, 3 * len(plan.steps), n_calls], rel=1e-4)
    # pipelined: the prediction is parts . terms at any terms (it scales with them)
    shape = replace(shape, chunks=4)
    for terms in ((1.0, 1.0, 0.0, 0.0), (0.7, 2.5, 3e-4, 1e-3), (1.4, 0.5, 0.0, 4e-3)):
        want = plan_cost(build_plan("s1", True), shape,
                         replace(DEFAULT_PROFILE, layer=terms))["total_s"]
        assert parts("s1", shape, DEFAULT_PROFILE, terms) @ np.array(terms) == \
            pytest.approx(want, rel=1e-5)


def test_evaluate_fits_pipelined_runs_and_scores_the_chunk_count():
    terms = (1.3, 2.0, 3e-4, 2e-3)
    runs = _synthetic_runs(terms, chunks=(2, 4))
    result = validation.evaluate(runs, DEFAULT_PROFILE)
    fitted = result["summary"]["layer_terms"]
    assert [fitted[k] for k in LAYER_KEYS] == pytest.approx(terms, rel=1e-4)
    assert result["summary"]["median_abs_rel_error"] == pytest.approx(0.0, abs=1e-6)
    assert result["summary"]["held_out_runs"] == 36  # 12 configurations at r = 1, 2, 4
    depths = result["depths"]
    assert len(depths) == result["summary"]["depth_choices"] >= 12
    assert all(d["excess"] == pytest.approx(0.0, abs=1e-9) for d in depths)
    # a measurement where the model's r runs twice as slow is counted as missed
    first = depths[0]
    for run in runs:
        if validation.base_name(run["name"]) == first["config"] and \
                run["config"]["moe_parm_chunks"] == first["chosen"]:
            run["schedules"][first["schedule"]]["total_ms"]["max"] *= 2.0
    again = validation.evaluate(runs, DEFAULT_PROFILE)
    assert again["summary"]["depth_within_10pct"] == len(depths) - 1
    assert again["summary"]["depth_worst_excess"] > 0.1
    assert "chunk count r" in format_report(again)


def test_node_grid_and_chunk_flags():
    node = validation.grid(validation.node_layouts(2), validation.NODE_SHAPES, 2)
    assert len(node) == 16 and {layout for layout, _ in node} == set(validation.node_layouts(2))
    # 2 nodes of 4: EP doubled, MP 4 allowed; most EP groups cross the node boundary, and no
    # configuration pairs a layout with an expert count its EP does not divide
    eight = validation.node_layouts(4, 8)
    assert len(eight) == len(validation.LAYOUTS) and (4, 2, 4, False) in eight
    assert sum(remote_share(ep, esp, 4) > 0 for _, ep, esp, _ in eight) >= 6
    node8 = validation.grid(eight, validation.NODE_SHAPES, 2)
    assert len(node8) == 16 and all(shape[4] % layout[1] == 0 for layout, shape in node8)
    assert not set(validation.NODE_SHAPES) & set(validation.SHAPES)
    argv = validation.config_argv(*node[0], 4)
    assert argv[argv.index("--moe-parm-chunks") + 1] == "4"
    assert argv[argv.index("--schedules") + 1] == "s1,s2"
    assert command.parse(["--nodes", "2"]).chunks == [2, 4, 8]
    assert command.parse([]).chunks == [] and command.parse(["--chunks", "2,8"]).chunks == [2, 8]
    with pytest.raises(SystemExit):
        command.parse(["--chunks", "1"])
