"""tools/bench_sweep.py without launches: the grid is large and spans 2, 4 and 8 ranks, and the
summary picks the best Parm row and its ratios to deepspeed-ted and to the best megatron
dispatcher from bench_moe_layer-like runs, leaving out rows that did not run."""

import importlib.util

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_sweep", ROOT / "tools/bench_sweep.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def _row(ms):
    if ms is None:
        return {"status": "skipped", "reason": "cannot run"}
    return {"status": "ok", "forward_ms": {"max": ms / 2}, "backward_ms": {"max": ms / 2}}


def test_grid():
    configs = tool.grid()
    assert len(configs) >= 20 and {w for _, w, _ in configs} == {2, 4, 8}
    for name, world, argv in configs:
        mp = int(argv[argv.index("--tensor-model-parallel-size") + 1])
        assert ("--sequence-parallel" in argv) == (mp > 1), name


def test_summary_and_table(tmp_path):
    runs = [{"name": "a", "schedules": {"s1": _row(8.0), "s2": _row(6.0), "auto": _row(7.0),
                                        "megatron-alltoall": _row(12.0),
                                        "megatron-allgather": _row(10.0),
                                        "deepspeed-ted": _row(9.0), "baseline": _row(5.0)}},
            {"name": "b", "schedules": {"s1": _row(4.0), "s2": _row(None),
                                        "deepspeed-ted": _row(None),
                                        "megatron-alltoall": _row(2.0)}}]
    summary = tool.summarise(runs)
    a, b = summary["configs"]
    assert a["best_parm"] == "s2" and a["fastest"] == "baseline"
    assert a["parm_over_ted"] == pytest.approx(6 / 9)
    assert a["parm_over_megatron"] == pytest.approx(6 / 10)
    assert b["best_parm"] == "s1" and b["parm_over_ted"] is None
    assert b["parm_over_megatron"] == pytest.approx(2.0) and b["fastest"] == "megatron-alltoall"
    assert summary["parm_over_ted"]["configs"] == 1
    assert summary["parm_over_megatron"] == {"min": 0.6, "median": 1.3, "max": 2.0,
                                             "configs": 2}
    table = tool.markdown(summary)
    assert "| a | 5.0 (0.56) |" in table and "| b | - |" in table
