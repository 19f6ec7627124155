"""tools/validate_cost_model.py without launches: the layer-term fit recovers known terms and
keeps them non-negative, rounds are averaged, and scoring on a synthetic bench result made from
known terms gives zero error and the right choices. Single process.
"""

import importlib.util
import json
from dataclasses import replace

import numpy as np
import pytest

from conftest import ROOT
from parm_trainer.moe.cost_model import DEFAULT_PROFILE, plan_cost
from parm_trainer.moe.schedules import build_plan

spec = importlib.util.spec_from_file_location("validate_cost_model",
                                              ROOT / "tools/validate_cost_model.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def test_nnls_matches_least_squares_and_clips_negative_terms():
    rng = np.random.default_rng(0)
    a = rng.uniform(0.1, 1.0, size=(20, 3))
    x = np.array([2.0, 0.5, 0.3])
    assert tool._nnls(a, a @ x) == pytest.approx(x, rel=1e-9)
    # a target that wants a negative third term: that term is held at 0
    b = a @ np.array([1.0, 1.0, -0.5])
    got = tool._nnls(a, b)
    assert got[2] == 0.0 and (got >= 0).all()
    free = np.linalg.lstsq(a[:, :2], b, rcond=None)[0]
    assert got[:2] == pytest.approx(free, rel=1e-9)


def test_grid_has_held_out_configurations_on_many_layouts():
    configs = tool.grid()
    assert len(configs) >= 32 and len(configs) - len(configs) // 4 >= 24
    assert len({layout for layout, _ in configs}) == len(tool.LAYOUTS)
    assert all(layout[0] >= 2 for layout, _ in configs)  # MP 1 leaves nothing to choose
    # on nodes of 2 ranks (--nodes): only layouts whose MP groups stay inside a node, each met
    node = tool.grid(tool.node_layouts(2))
    assert len(node) == len(configs) and {layout[0] for layout, _ in node} == {2}
    assert len({layout for layout, _ in node}) == len(tool.node_layouts(2)) >= 4


def _synthetic_runs(terms):
    """bench_moe_layer-like runs whose times are exactly the model's with `terms`."""
    truth = replace(DEFAULT_PROFILE, layer=terms)
    runs = []
    for i, (layout, shape) in enumerate(tool.grid()[:12]):
        (mp, ep, esp, sp), (seq, mbs, hidden, ffn, experts, topk, factor) = layout, shape
        config = {"tokens_per_mp_group": seq * mbs, "hidden_size": hidden,
                  "moe_ffn_hidden_size": ffn, "num_experts": experts, "moe_router_topk": topk,
                  "moe_expert_capacity_factor": factor, "tensor_model_parallel_size": mp,
                  "expert_model_parallel_size": ep, "expert_tensor_parallel_size": esp,
                  "sequence_parallel": sp, "moe_parm_chunks": 1}
        shape_ = tool.layer_shape(config)
        schedules = {}
        for name in tool.SCHEDULES:
            try:
                seconds = plan_cost(build_plan(name, sp), shape_, truth)["total_s"]
            except ValueError as error:
                schedules[name] = {"status": "skipped", "reason": str(error)}
                continue
            schedules[name] = {"status": "ok", "forward_ms": {"max": seconds * 1e3 / 3},
                               "backward_ms": {"max": seconds * 1e3 * 2 / 3},
                               "total_ms": {"max": seconds * 1e3}}
        runs.append({"name": f"c{i:02d}", "config": config, "schedules": schedules})
    return runs


def test_evaluate_recovers_the_terms_behind_synthetic_measurements(tmp_path):
    terms = (2.0, 1.5, 2e-4, 5e-4)
    runs = _synthetic_runs(terms)
    result = tool.evaluate(runs, DEFAULT_PROFILE, {"c00", "c04", "c08"})
    fitted = result["summary"]["layer_terms"]
    assert [fitted[k] for k in tool.LAYER_KEYS] == pytest.approx(terms, rel=1e-6)
    assert result["summary"]["median_abs_rel_error"] == pytest.approx(0.0, abs=1e-9)
    assert result["summary"]["held_out_configs"] == 9
    assert result["summary"]["auto_right_all"] == 9  # exact times: auto is always right
    assert "median |predicted - measured|" in tool.format_report(result)
    png = tool.write_png(result, str(tmp_path / "v.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_rounds_are_averaged(tmp_path):
    runs = _synthetic_runs(tool.LAYER_DEFAULT)[:2]
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
    merged = tool.merge_rounds([str(p) for p in paths])
    assert [run["name"] for run in merged] == [run["name"] for run in runs]
    for got, want in zip(merged, runs):
        for name, r in want["schedules"].items():
            if r["status"] == "ok":
                assert tool.measured_s(got["schedules"][name]) == \
                    pytest.approx(2.0 * tool.measured_s(r))
