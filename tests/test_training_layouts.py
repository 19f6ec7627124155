"""One model, many layouts: the same seed and global batch must give the same losses.

Weights are drawn layout-free (parm_trainer.models.init) and the sampler hands out the same
micro-batches for every data-parallel size, so 1 rank, TP2xEP2xESP2 on 4 ranks, TP2 with ESP1
and PP2 must agree to floating-point reordering. Each launch checks a whole layout at once.
"""

import json

import pytest

from conftest import launch, max_relative, tiny_gpt_args

TP2_EP2_ESP2_SP = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
                   "expert-tensor-parallel-size": 2, "sequence-parallel": True}
LAYOUTS = {
    # Parm's s1 and the others must train the same model identically (the default, auto, is
    # test_default_auto_measures_then_reads_its_cache)
    "tp2_ep2_esp2": (4, {**TP2_EP2_ESP2_SP, "moe-parm-schedule": "s1", "moe-parm-chunks": 1}),
    "tp2_ep2_esp2_s2": (4, {**TP2_EP2_ESP2_SP, "moe-parm-schedule": "s2"}),
    "tp2_ep2_esp2_baseline": (4, {**TP2_EP2_ESP2_SP, "moe-parm-schedule": "baseline"}),
    "tp2_ep2_esp2_megatron": (4, {**TP2_EP2_ESP2_SP, "moe-parm-schedule": "megatron"}),
    # without sequence parallelism s1 splits the replicated tokens itself; two-piece exchange
    "tp2_ep2_s1_no_sp_chunks2": (4, {"tensor-model-parallel-size": 2,
                                     "expert-model-parallel-size": 2, "moe-parm-chunks": 2,
                                     "moe-parm-schedule": "s1"}),
    # ESP differs from MP with EP=1: expert grads must be summed over the expert-DP group
    "tp2_esp1": (2, {"tensor-model-parallel-size": 2, "expert-tensor-parallel-size": 1,
                     "sequence-parallel": True}),
    "pp2": (2, {"pipeline-model-parallel-size": 2}),
}


@pytest.fixture(scope="module")
def reference(gpt_data, tmp_path_factory):
    run = launch(1, tiny_gpt_args(gpt_data), tmp_path_factory.mktemp("ref"))
    assert run.returncode == 0, run.output[-4000:]
    return run


@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_five_losses_match_single_rank(layout, reference, gpt_data, tmp_path):
    nproc, flags = LAYOUTS[layout]
    run = launch(nproc, tiny_gpt_args(gpt_data, **flags), tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    expected, got = reference.loss(), run.loss()
    assert len(got) == len(expected) == 5
    assert max_relative(got, expected) < 1e-4, (got, expected)
    # the load-balancing loss is part of the same function
    assert max_relative(run.loss("load_balancing_loss"),
                        reference.loss("load_balancing_loss")) < 1e-4
    # the routers sent every expert the same tokens (counts summed over the ranks)
    assert run.loss("tokens per expert") == reference.loss("tokens per expert")


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
    for candidate in ("s1 r=1", "s1 r=2", "s1 r=4", "s2 r=1", "s2 r=2", "s2 r=4"):
        assert f"{candidate} " in said[0], said[0]
    table = json.loads(cache.read_text())
    (entry,) = table.values()
    name, chunks = entry["choice"]
    assert said[0].endswith(f"using {name} with --moe-parm-chunks {chunks}")
    assert entry["measured_ms"][f"{name} r={chunks}"] == min(entry["measured_ms"].values())
    again = [line for line in second.output.splitlines()
             if line.startswith("--moe-parm-schedule auto --moe-parm-chunks 0:")]
    assert len(again) == 1 and f"(cached in {cache})" in again[0], second.output[-4000:]
    assert again[0].endswith(f"using {name} with --moe-parm-chunks {chunks}")
