"""bench_sweep without launches (parm_trainer/bench/sweep.py; the tool's flags and commands):
the grid is large and spans 2, 4 and 8 ranks, and the
summary picks the best Parm row and its ratios to deepspeed-ted, to the best megatron
dispatcher and to its own link floor from bench_moe_layer-like runs, leaving out rows that did
not run; --nodes spreads each world over emulated nodes, and a world it cannot split evenly is
refused before anything starts."""

import importlib.util

import pytest

from conftest import ROOT
from parm_trainer.bench.sweep import grid, markdown, summarise

spec = importlib.util.spec_from_file_location("bench_sweep", ROOT / "tools/bench_sweep.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def _row(ms, floor=None):
    if ms is None:
        return {"status": "skipped", "reason": "cannot run"}
    return {"status": "ok", "forward_ms": {"max": ms / 2}, "backward_ms": {"max": ms / 2},
            "total_ms": {"max": ms}, "link_floor_ms": floor}


def test_grid():
    configs = grid()
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
    summary = summarise(runs)
    a, b = summary["configs"]
    assert a["best_parm"] == "s2" and a["fastest"] == "baseline"
    assert a["parm_over_ted"] == pytest.approx(6 / 9)
    assert a["parm_over_megatron"] == pytest.approx(6 / 10)
    assert b["best_parm"] == "s1" and b["parm_over_ted"] is None
    assert b["parm_over_megatron"] == pytest.approx(2.0) and b["fastest"] == "megatron-alltoall"
    assert summary["parm_over_ted"]["configs"] == 1
    assert summary["parm_over_megatron"] == {"min": 0.6, "median": 1.3, "max": 2.0,
                                             "configs": 2}
    table = markdown(summary)
    assert "| a | 5.0 (0.56) |" in table and "| b | - |" in table
    # one node: no floors, the floor columns show -
    assert a["floor_ms"] is None and a["parm_over_floor"] is None
    assert summary["parm_over_floor"] is None
    assert table.splitlines()[2].endswith("| 0.67 | 0.60 | - | - |")


def test_link_floor(tmp_path):
    """The floor is the best Parm row's own (s2 here, not s1's smaller one); a configuration
    whose best Parm row has no floor (bytes unseen, or none cross nodes) is left out."""
    runs = [{"name": "a", "schedules": {"s1": _row(8.0, 1.0), "s2": _row(6.0, 2.0),
                                        "baseline": _row(9.0, 3.0),
                                        "megatron-alltoall": _row(5.0)}},
            {"name": "b", "schedules": {"s1": _row(4.0, 1.0), "auto": _row(3.0, 0.5)}},
            {"name": "c", "schedules": {"s2": _row(7.0, 1.75)}},
            {"name": "d", "schedules": {"s1": _row(4.0)}}]
    summary = summarise(runs)
    a, b, c, d = summary["configs"]
    assert (a["best_parm"], a["floor_ms"], a["parm_over_floor"]) == ("s2", 2.0, 3.0)
    assert (b["best_parm"], b["floor_ms"], b["parm_over_floor"]) == ("auto", 0.5, 6.0)
    assert c["parm_over_floor"] == 4.0
    assert d["floor_ms"] is None and d["parm_over_floor"] is None
    assert summary["parm_over_floor"] == {"min": 3.0, "median": 4.0, "max": 6.0, "configs": 3}
    lines = markdown(summary).splitlines()
    assert lines[0].endswith("| floor ms | best Parm / floor |")
    assert lines[2].endswith("| - | 1.20 | 2.0 | 3.00 |")  # a: s2 over megatron, floor, ratio
    assert lines[5].endswith("| - | - | - | - |")  # d


def test_nodes(tmp_path, monkeypatch, capsys):
    """With --nodes each world runs under tools/emulated_cluster.py with world / nodes ranks
    per node, and bench_moe_layer gets no --nproc; a world --nodes does not divide is refused."""
    args = tool.parse(["--nodes", "2", "--worlds", "2,4", "--out-dir", str(tmp_path)])
    command = tool.bench_command(args, 4, "c.json", "b.json")
    assert command[1].endswith("emulated_cluster.py") and "--nproc" not in command
    assert command[command.index("--procs-per-node") + 1] == "2"
    assert command[command.index("--inter-node-bandwidth") + 1] == "200mbit"
    assert command[command.index("--log-dir") + 1] == str(tmp_path / "nodes_w4")
    assert command[command.index("--") + 1].endswith("bench_moe_layer.py")
    assert command[-4:] == ["--configs", "c.json", "--json", "b.json"]
    one = tool.bench_command(tool.parse([]), 4, "c.json", "b.json")
    assert one[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    assert one[6].endswith("bench_moe_layer.py") and one[-4:] == command[-4:]
    for bad in (["--nodes", "4", "--worlds", "2,4,8"], ["--nodes", "0"]):
        with pytest.raises(SystemExit):
            tool.main(bad + ["--out-dir", str(tmp_path / "refused")])
        assert "must be a positive multiple of it" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
