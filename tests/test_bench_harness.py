"""The benchmark harness (parm_trainer/bench/) without launches, and the shape of tools/: the
rows --schedules and --peers ask for, the table of a run, the byte report; every tool a thin
command (at most 300 lines, no sys.path edits, no imports of another tool), DeepSpeed's adapter
imported only when one of its rows runs (the import graph: tests/test_imports.py). Single process.

    .venv/bin/python -m pytest tests/test_bench_harness.py -q
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from conftest import ROOT
from parm_trainer.bench import flags, ledger, peers, report

SMALL = ["--num-experts", "4", "--hidden-size", "32", "--moe-ffn-hidden-size", "64"]


def test_rows_of_schedules_and_peers():
    rows = lambda *argv: flags.parse([*SMALL, *argv], world_size=4).schedule_list  # noqa: E731
    assert rows() == ["baseline", "s1", "s2", "megatron"]
    assert rows("--peers", "megatron-alltoall,megatron-allgather,deepspeed") == [
        "baseline", "s1", "s2", "megatron-alltoall", "megatron-allgather", *peers.DEEPSPEED]
    assert rows("--schedules", "s1,auto", "--peers", "deepspeed-ted,deepspeed") == [
        "s1", "auto", "deepspeed-ted", "deepspeed-ep", "deepspeed-dedup"]
    assert rows("--schedules", "s2,deepspeed") == ["s2", *peers.DEEPSPEED]
    assert rows("--schedules", "s1/r2,s2/r16,auto,s1/r2/local") == [
        "s1/r2", "s2/r16", "auto", "s1/r2/local"]
    assert flags.depth_row("s2/r16") == ("s2", 16, False) and flags.depth_row("s1") is None
    assert flags.depth_row("s1/r2/local") == ("s1", 2, True)
    for bad, said in ((["--peers", "s1"], "--peers: unknown ['s1']"),
                      (["--peers", ""], "--peers: unknown []"),
                      (["--schedules", "s3"], "--schedules: unknown ['s3']"),
                      (["--schedules", "s1/r0,baseline/r2,s1/local"],
                       "--schedules: unknown ['s1/r0', 'baseline/r2', 's1/local']"),
                      (["--peers", "deepspeed", "--bf16"], "--bf16: the DeepSpeed peers"),
                      (["--fp16"], "--fp16: the layer benchmark measures fp32 or --bf16")):
        with pytest.raises(flags.ToolError, match=said.replace("[", r"\[").replace("]", r"\]")):
            rows(*bad)


def _ok(ms, kib=None, auto=None, plan="s1: ..."):
    per_rank = None if kib is None else {phase: {kind: [int(kib * 1024 / 2)] * 2
                                                 for kind in ledger.KINDS}
                                         for phase in ("forward", "backward")}
    return {"status": "ok", "plan": plan, "chunks": 2, "auto_choice": auto,
            "forward_ms": {"rank0": ms / 2, "max": ms / 2},
            "backward_ms": {"rank0": ms / 2, "max": ms / 2}, "total_ms": {"max": ms},
            "bytes": per_rank, "cross_node_bytes": None,
            "max_abs_diff": dict.fromkeys(report.DIFF_KEYS, 1e-8)}


def test_table():
    args = flags.parse([*SMALL, "--ratio-to", "s1"], world_size=4)
    schedules = {"s1": _ok(10.0, kib=4.0), "auto": _ok(5.0, kib=2.0, auto="chose", plan="s2: x"),
                 "megatron": _ok(20.0), "deepspeed-ted": {"status": "skipped",
                                                          "reason": peers_not_installed()}}
    assert report.row_ratios(schedules, args, None) is None
    run = {"name": "c0", "config": {**report.config_summary(args), "world_size": 4},
           "schedules": schedules, "unique_payload_bytes": None}
    lines = report.format_table(run).splitlines()
    assert lines[0].startswith("[c0] MoE layer: world 4 (cpu), MP 1 EP 1 ESP 1 DP 4; E 4 top-2")
    assert lines[1].split() == ["schedule", *" ".join(report.COLUMNS[1:]).split()]
    assert lines[2].split()[:6] == ["s1", "5.00/5.00", "5.00/5.00", "10.00", "1.00", "4.0"]
    assert lines[3].split()[:5] == ["auto=s2/r2", "2.50/2.50", "2.50/2.50", "5.00", "0.50"]
    assert lines[4].split()[3:6] == ["20.00", "2.00", "null"]
    assert lines[5].split(None, 1) == ["deepspeed-ted", "skipped: " + peers_not_installed()]
    assert "ratio: fwd+bwd / s1's" in lines[6]


def peers_not_installed():
    from parm_trainer.bench.peers.deepspeed import NOT_INSTALLED

    return NOT_INSTALLED


def test_bytes_report():
    per_rank = [{"alltoall/ep/forward": 10, "allgather/esp/backward": 3},
                {"alltoall/ep/forward": 7, "alltoall/ep/backward": 1}]
    got = ledger.bytes_report(per_rank)
    assert got["forward"]["alltoall"] == [10, 7] and got["backward"]["alltoall"] == [0, 1]
    assert got["backward"]["allgather"] == [3, 0] and got["forward"]["allreduce"] == [0, 0]
    assert got["by_group"]["forward"] == {"alltoall/ep": [10, 7]}


def test_deepspeed_imported_only_when_asked():
    code = ("import sys; import parm_trainer.bench.harness, parm_trainer.bench.flags; "
            "print(sorted(m for m in sys.modules if 'deepspeed' in m))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


TOOLS = sorted((ROOT / "tools").rglob("*.py"))


def _imports(path):
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", [pytest.param(p, id=str(p.relative_to(ROOT))) for p in TOOLS])
def test_tools_are_thin_commands(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 300, "a tool over 300 lines: move its logic to the package"
    assert "sys.path" not in text, "the package is installed (editable): no sys.path edits"
    siblings = {p.stem for p in TOOLS} - {path.stem}
    imported = {name.split(".")[0] for name in _imports(path)}
    assert not imported & siblings, f"imports another tool: {imported & siblings}"


def test_no_file_over_500_lines():
    """Every Python file of the project under 500 lines: a longer one holds several concerns."""
    long = [f"{path.relative_to(ROOT)}: {n}" for path in sorted(ROOT.rglob("*.py"))
            if not {".venv", "runs", "data"} & set(path.relative_to(ROOT).parts)
            and (n := len(path.read_text().splitlines())) > 500]
    assert not long, f"over 500 lines: {long}"


def test_shared_expert_rows():
    assert flags.shared_row("s1/r2/shared-overlap") == ("s1/r2", True)
    assert flags.shared_row("s2/shared-before") == ("s2", False)
    assert flags.shared_row("megatron/shared-overlap") == ("megatron/shared-overlap", None)
    assert flags.shared_row("s1/r2/local") == ("s1/r2/local", None)
