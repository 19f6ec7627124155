"""Today's MoE blocks through Parm's layer, against megatron-core's own MoELayer.

A launch of 4 gloo ranks (and one of 8) runs tests/worker_moe_features.py: for every layout of its list
(MP 1 x EP 1 with four replicas, MP 1 x EP 4, MP 2 x EP 2 x ESP 2 with sequence parallelism,
MP 2 x EP 2 x ESP 1 and MP 2 x ESP 2 without it) and every feature set (sigmoid scores, the
expert bias, group-limited top-k, the top-k scaling factor, an fp64 router with z-loss, a
shared expert with and without its gate, seq_aux_loss, global_aux_loss, and their
DeepSeek-V3-like combination, dropless and with a capacity factor), Parm's layer under s1, s2
and the baseline, at depths 1, 2 and 4, on the exact, direct and padded exchanges, with the
shared expert overlapped and not, must give megatron's output, gradients and router losses
(1e-5), and 5 rounds of megatron's expert-bias update the same bias.

    .venv/bin/python -m pytest tests/test_moe_features.py -q
"""

from pathlib import Path

from conftest import RANK_MAIN, run_rank_workers

WORKER = (Path(__file__).parent / "worker_moe_features.py").read_text()


def test_features_equal_megatrons_layer_on_four_ranks(tmp_path):
    source = f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n" + WORKER
    reports = run_rank_workers(tmp_path, source + RANK_MAIN, 4, timeout=900)
    assert len(reports) == 4
    cases = reports[0]["cases"]
    assert len(set(cases)) == len(cases) > 300, len(cases)
    for words in ("MP2 EP2 ESP2 SP deepseek s1/r4/exact", "MP1 EP4 ESP1 deepseek_capacity s2/r1",
                  "MP2 EP2 ESP1 shared_gate s2/r1/exact/overlap", "global_aux_loss baseline"):
        assert any(words in case for case in cases), words
    assert len({r["checks"] for r in reports}) == 1


def test_the_combination_equals_megatrons_layer_on_eight_ranks(tmp_path):
    """MP 2 x EP 2 x ESP 2 with SP and MP 1 x EP 8: the DeepSeek-V3-like set, dropless and with
    a capacity factor."""
    source = f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n" + WORKER
    reports = run_rank_workers(tmp_path, source + RANK_MAIN, 8, timeout=900)
    cases = reports[0]["cases"]
    assert len(reports) == 8 and len(set(cases)) == len(cases) >= 30, len(cases)
    assert any("MP1 EP8 ESP1 deepseek_capacity s2/r4/padded" in case for case in cases)


def test_a_shared_expert_with_biases_is_refused():
    """megatron-core's SharedExpertMLP asserts add_bias_linear False; here one line first."""
    import pytest

    from parm_trainer.arguments import ArgumentsError, parse_args

    with pytest.raises(ArgumentsError, match="shared expert has no biases; add "
                                             "--disable-bias-linear"):
        parse_args(["--num-experts", "4", "--moe-shared-expert-intermediate-size", "8"])
