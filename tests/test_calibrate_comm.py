"""tools/calibrate_comm.py (parm_trainer/bench/calibration/): one 2-rank
gloo launch on a small size range writes a cost profile
that Profile.from_json loads, whose alpha and beta for every kind are the least-squares fit of
the points it reports (recomputed here), with each fit's r^2. No timing is asserted beyond that (CPU timings are noisy).

    .venv/bin/python -m pytest tests/test_calibrate_comm.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import python, served_env
from parm_trainer.bench.calibration import collectives, fit
from parm_trainer.moe.cost_profile import KINDS, Profile


def test_two_rank_calibration_writes_loadable_profile(tmp_path):
    out = tmp_path / "profile.json"
    # the tool's own process forked from the tests' server (conftest.python), its 2 ranks
    # started by its --nproc (torchrun, served too: PARM_TORCHRUN); one call per timed sample
    # (--calls 1)
    result = python("tools/calibrate_comm.py", "--nproc", "2", "--sizes", "4096,65536,524288",
                    "--repeats", "3", "--warmup", "1", "--calls", "1", "--output", out,
                    env={"OMP_NUM_THREADS": "1", **served_env(python=False)}, timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]

    profile = Profile.from_json(str(out))
    assert profile.gpus_per_node == 2 and profile.world_size == 2
    assert profile.compute[0] > 0 and profile.compute[1] > 0
    assert "'inter' not measured" in profile.description  # one machine: intra copied

    data = json.loads(out.read_text())
    for kind in KINDS:
        intra, inter = data["fit"][kind]["intra"], data["fit"][kind]["inter"]
        assert intra["measured"] and not inter["measured"]
        assert intra["group_size"] == 2 and len(intra["points"]) == 3
        assert f"{kind:<14}intra" in result.stdout  # the table row
        # the profile's rates are the fit of the reported points, and r^2 theirs
        alpha, beta = profile.collectives[kind]["intra"]
        assert profile.collectives[kind]["inter"] == (alpha, beta)  # copied
        _check_fit(intra, alpha, beta)
    gemm = data["fit"]["compute"]
    assert len(gemm["points"]) >= 4 and "compute" in result.stdout
    _check_fit(gemm, *profile.compute)
    assert profile.memory[0] >= 0 and profile.memory[1] > 0 and data["fit"]["memory"]["points"]
    # the GEMMs again with 1 and with 2 ranks computing, over both at once (link_sharing.py);
    # one node: no link sharing to measure
    assert [k for k, _ in profile.compute_concurrency] == [1, 2]
    assert profile.compute_concurrency[-1][1] == 1.0 and profile.compute_concurrency[0][1] > 0
    waits = data["fit"]["sync_wait"]  # 3 rounds x 3 collectives x 3 stretches, (stretch, wait) s
    assert "a collective after compute waits" in result.stdout
    assert len(waits) == 27 and all(stretch > 0 and wait >= 0 for stretch, wait in waits)
    assert profile.layer[3] == pytest.approx(sorted(w for _, w in waits)[13])  # their median
    assert profile.node_links is None and "compute time with k ranks" in result.stdout


def _check_fit(entry, alpha, beta):
    """entry's points fitted here, by least squares on alpha, beta >= their floors: the
    profile's alpha and beta, and entry's r^2 that of those points under that line."""
    x, y = np.array(entry["points"], dtype=float).T
    slope, intercept = np.polyfit(x, y, 1)
    if entry["clamped"]:  # the unconstrained fit left the positive quadrant: one at its floor
        assert alpha == fit.ALPHA_FLOOR or beta == fit.BETA_FLOOR, entry
    else:
        assert alpha == pytest.approx(intercept, rel=1e-6) and \
            beta == pytest.approx(slope, rel=1e-6), (entry, intercept, slope)
    spread = np.sum((y - y.mean()) ** 2)
    want = 1.0 - np.sum((y - alpha - beta * x) ** 2) / spread if spread else 1.0
    assert entry["r2"] == pytest.approx(want, rel=1e-9, abs=1e-12), (entry, want)


def test_groups_and_node_share():
    """Which groups each link class is measured on, and the factor from a rank's fitted
    bandwidth to its node's link: the ranks of a node sending at once, times the share of
    their peers on other nodes."""

    # 2 nodes x 2 ranks, groups of 2: pairs inside a node, pairs one node apart
    groups = collectives.calibration_groups(4, 2, 2)
    assert groups == {"intra": [[0, 1], [2, 3]], "inter": [[0, 2], [1, 3]]}
    assert collectives.node_share(groups["inter"], 2) == 2.0   # both ranks of a node, all peers remote
    assert collectives.node_share(groups["intra"], 2) == 0.0
    # the whole world of 2 x 4: 4 ranks per node at once, 4 of each rank's 7 peers remote
    world = collectives.calibration_groups(8, 4)
    assert world["inter"] == [list(range(8))]
    assert collectives.node_share(world["inter"], 4) == pytest.approx(4 * 4 / 7)
    assert collectives.remote_peers(world["inter"], 4) == pytest.approx(4 / 7)
    assert collectives.remote_peers(groups["inter"], 2) == 1.0


def test_inter_alltoall_beta_is_per_byte_that_crosses(tmp_path, capsys):
    """Measured on the whole world of 2 x 4 ranks, 3 of each rank's 7 AlltoAll peers share its
    node: the profile's inter AlltoAll beta is the fitted one over the remote share 4/7 (the
    model prices only the remote share of the bytes, Profile.price), ring collectives' as
    fitted. Synthetic points, exact lines."""
    import argparse

    from parm_trainer.bench.calibration.report import report
    sizes = [2 ** 18 * 2 ** i for i in range(5)]
    line = lambda alpha, beta: [(b, alpha + b * beta) for b in sizes]  # noqa: E731
    measured = {link: (4 if link == "intra" else 8,
                       {kind: line(1e-4, (1e-8 if link == "inter" else 1e-9)) for kind in KINDS})
                for link in ("intra", "inter")}
    local = {"compute": line(1e-5, 1e-11), "memory": line(1e-6, 1e-10)}
    groups = collectives.calibration_groups(8, 4)
    args = argparse.Namespace(sizes=sizes, repeats=3, warmup=1, name="t", require_r2=False,
                              output=str(tmp_path / "p.json"))
    assert report(args, "gloo", 8, 4, 2, measured, local,
                       {link: collectives.node_share(g, 4) for link, g in groups.items()},
                       {link: collectives.remote_peers(g, 4) for link, g in groups.items()}) == 0
    profile = Profile.from_json(str(tmp_path / "p.json"))
    assert profile.collectives["alltoall"]["inter"][1] == pytest.approx(1e-8 * 7 / 4)
    assert profile.collectives["allgather"]["inter"][1] == pytest.approx(1e-8)
    assert profile.collectives["alltoall"]["intra"][1] == pytest.approx(1e-9)


@pytest.mark.alone  # the stretches are GEMMs timed against the cores' own speed
def test_wait_at_a_call_is_measured_in_each_nodes_group(tmp_path):
    """On 2 nodes x 2 ranks the wait is measured in the groups where MP collectives run (each
    node's ranks, both at once), not across the node link: 3 collectives x 3 stretches of
    compute per round (the longest longer than the shortest: a timing, kept weak; their
    lengths are test_stretches_are_whole_gemms_of_the_fastest_ranks_unit's). The same launch times a
    send from the first node to the second back to back and after a pause at every size
    (none on one node)."""
    from conftest import free_port, torchrun
    status, output = torchrun(["--nproc-per-node", 4, "--master-port", free_port(),
                               "tests/worker_calibration_waits.py"], timeout=120)
    assert status == 0, output[-3000:]
    assert "groups [[[0, 1], [2, 3]]] points 18 ok True stretches True" in output
    from parm_trainer.bench.calibration.waits import BURST_SIZES
    assert f"burst sizes {list(BURST_SIZES)} timed True one node []" in output


def test_stretches_are_whole_gemms_of_the_fastest_ranks_unit():
    """Each stretch repeats the GEMM to its target length, at least once: a slow unit (a
    loaded machine) shortens the ratio between them, never to no compute."""
    from parm_trainer.bench.calibration.waits import WAIT_STRETCHES, stretch_repeats
    assert WAIT_STRETCHES == (0.002, 0.008, 0.03)
    assert stretch_repeats(0.0005) == [4, 16, 60]
    assert stretch_repeats(0.003) == [1, 3, 10]
    assert stretch_repeats(1.0) == [1, 1, 1]


def test_burst_is_read_from_sends_after_a_pause():
    """burst_from: a link that lets B bytes through at once after a pause saves B at the
    sustained rate on every send longer than B (exact synthetic lines); one that saves
    nothing has no burst; sends all inside the burst bound it from below."""
    from parm_trainer.bench.calibration.waits import BURST_SIZES, burst_from

    def points(bucket):
        return [(b, 1e-4 + b * 4e-8, 1e-4 + max(0, b - bucket) * 4e-8) for b in BURST_SIZES]
    assert burst_from(points(250_000)) == pytest.approx(250_000)
    assert burst_from(points(100_000)) == pytest.approx(100_000)
    assert burst_from(points(0)) == 0.0
    assert burst_from(points(10 ** 8)) == pytest.approx(BURST_SIZES[-1])
    assert burst_from([]) == 0.0
