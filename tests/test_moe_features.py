"""Today's MoE blocks through Parm's layer, against megatron-core's own MoELayer.

A launch of 4 gloo ranks (and of 1, 2 and 8) runs tests/worker_moe_features.py: for every layout of its list
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

import re

import pytest

from conftest import launch, max_relative, run_rank_workers, tiny_gpt_args



def test_features_equal_megatrons_layer_on_four_ranks(tmp_path):
    reports = run_rank_workers(tmp_path, "worker_moe_features.py", 4, timeout=900)
    assert len(reports) == 4
    cases = reports[0]["cases"]
    assert len(set(cases)) == len(cases) > 300, len(cases)
    for words in ("MP2 EP2 ESP2 SP deepseek s1/r4/exact", "MP1 EP4 ESP1 deepseek_capacity s2/r1",
                  "MP2 EP2 ESP1 shared_gate s2/r1/exact/overlap", "global_aux_loss baseline"):
        assert any(words in case for case in cases), words
    assert len({r["checks"] for r in reports}) == 1


@pytest.mark.parametrize("world,least,example", [
    (1, 80, "MP1 EP1 ESP1 global_aux_loss s2/r4/padded"),
    (2, 70, "MP2 EP1 ESP2 SP deepseek s1/r2/exact/overlap"),
    (8, 30, "MP1 EP8 ESP1 deepseek_capacity s2/r4/padded")])
def test_the_blocks_equal_megatrons_layer_on_1_2_and_8_ranks(tmp_path, world, least, example):
    """One rank (every feature), and on 2 ranks (MP 1 x EP 2, MP 2 x ESP 2 with SP, MP 2 x EP
    2) and 8 (MP 2 x EP 2 x ESP 2 with SP, MP 1 x EP 8) the DeepSeek-V3-like set, dropless and
    with a capacity factor, and the gated shared expert."""
    reports = run_rank_workers(tmp_path, "worker_moe_features.py", world, timeout=900)
    cases = reports[0]["cases"]
    assert len(reports) == world and len(set(cases)) == len(cases) >= least, len(cases)
    assert any(example in case for case in cases), example


def test_a_shared_expert_with_biases_is_refused():
    """megatron-core's SharedExpertMLP asserts add_bias_linear False; here one line first."""
    from parm_trainer.arguments import ArgumentsError, parse_args

    with pytest.raises(ArgumentsError, match="shared expert has no biases; add "
                                             "--disable-bias-linear"):
        parse_args(["--num-experts", "4", "--moe-shared-expert-intermediate-size", "8"])


# A DeepSeek-V3-shaped GPT-MoE, small: the first layer dense, 16 fine-grained experts top-4 in
# 4 groups (2 chosen), sigmoid scores with the expert bias and a scaling factor, a gated shared
# expert, the sequence-level aux loss, an fp32 router; SwiGLU, RMSNorm, RoPE, no biases
DEEPSEEK_GPT = {"num-layers": 3, "moe-layer-freq": "([0]+[1]*2)", "num-experts": 16,
                "moe-router-topk": 4, "moe-ffn-hidden-size": 32,
                "moe-router-score-function": "sigmoid", "moe-router-enable-expert-bias": True,
                "moe-router-num-groups": 4, "moe-router-group-topk": 2,
                "moe-router-topk-scaling-factor": 2.5,
                "moe-shared-expert-intermediate-size": 64, "moe-shared-expert-gate": True,
                "moe-router-load-balancing-type": "seq_aux_loss", "moe-aux-loss-coeff": 0.001,
                "moe-router-dtype": "fp32", "swiglu": True, "normalization": "RMSNorm",
                "position-embedding-type": "rope", "untie-embeddings-and-output-weights": True,
                "train-iters": 20, "moe-parm-tune-cache": "none"}
TP2_EP2_SP = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
              "sequence-parallel": True}


def test_deepseek_like_gpt_trains_as_megatrons_layer(gpt_data, tmp_path):
    """20 iterations with Parm's default flags (auto schedule and depth, measured at start-up)
    and with megatron's own layer, TP 2 x EP 2 with SP: the same losses (1e-5 relative), the
    same tokens per expert (the expert bias moved alike); and Parm under PP 2 x EP 2 with s2
    and the shared expert overlapped trains the same model (the layout-free weights): its 8
    iterations, on the same learning-rate schedule, are the first 8 of megatron's."""
    runs = {}
    for name, flags in (("megatron", {**TP2_EP2_SP, "moe-parm-schedule": "megatron"}),
                        ("parm", {**TP2_EP2_SP, "moe-per-layer-logging": True}),
                        ("parm_pp2", {"pipeline-model-parallel-size": 2,
                                      "decoder-first-pipeline-num-layers": 2,
                                      "expert-model-parallel-size": 2,
                                      "moe-parm-schedule": "s2", "moe-parm-chunks": 2,
                                      "moe-shared-expert-overlap": True,
                                      "train-iters": 8, "lr-decay-iters": 20})):
        runs[name] = launch(4, tiny_gpt_args(gpt_data, **{**DEEPSEEK_GPT, **flags}), tmp_path)
        assert runs[name].returncode == 0, runs[name].output[-4000:]
        iterations = flags.get("train-iters", DEEPSEEK_GPT["train-iters"])
        assert len(runs[name].loss()) == iterations, runs[name].output[-3000:]
    megatron, parm = runs["megatron"], runs["parm"]
    assert "--moe-parm-schedule auto --moe-parm-chunks 0: forward+backward" in parm.output
    # auto measured the shared expert's place for its chosen schedule and depth
    assert re.search(r"with the shared expert before the gate [\d.]+ ms, overlapped with the "
                     r"exchange [\d.]+ ms", parm.output), parm.output[-3000:]
    assert max_relative(parm.loss(), megatron.loss()) < 1e-5
    assert max_relative(parm.loss("seq_load_balancing_loss"),
                        megatron.loss("seq_load_balancing_loss")) < 1e-5
    assert parm.loss("tokens per expert") == megatron.loss("tokens per expert")
    assert megatron.loss()[-1] < megatron.loss()[0] - 0.3  # it learns
    # --moe-per-layer-logging: each MoE layer's loss (not the dense first one's), their mean
    per_layer = re.findall(r"^router losses per MoE layer at iteration 20 \| layer 2: "
                           r"seq_load_balancing_loss ([\d.]+) \| layer 3: "
                           r"seq_load_balancing_loss ([\d.]+)$", parm.output, re.M)
    assert len(per_layer) == 1, parm.output[-3000:]
    mean = sum(map(float, per_layer[0])) / 2
    assert abs(mean - parm.loss("seq_load_balancing_loss")[-1]) < 1e-4
    assert max_relative(runs["parm_pp2"].loss(), megatron.loss()[:8]) < 1e-4  # its first 8


def test_moe_bert_with_the_features_trains_as_megatrons_layer(bert_data, tmp_path):
    """MoE BERT, EP 2 on 2 ranks, the same blocks (GELU, LayerNorm, learned positions): Parm's
    default flags and megatron's layer give the same masked-LM and sentence-order losses."""
    flags = {key: value for key, value in DEEPSEEK_GPT.items()
             if key not in ("swiglu", "normalization", "position-embedding-type")}
    flags.update({"expert-model-parallel-size": 2, "train-iters": 8})
    runs = [launch(2, tiny_gpt_args(bert_data, **flags, **extra), tmp_path,
                   script="pretrain_bert_moe.py")
            for extra in ({"moe-parm-schedule": "megatron"}, {})]
    for run in runs:
        assert run.returncode == 0 and len(run.loss()) == 8, run.output[-3000:]
    megatron, parm = runs
    for name in ("lm loss", "sop loss", "seq_load_balancing_loss"):
        assert max_relative(parm.loss(name), megatron.loss(name)) < 1e-5, name
    assert parm.loss("tokens per expert") == megatron.loss("tokens per expert")


def test_the_start_up_line_says_where_routing_groups_limit_the_exchange():
    from parm_trainer.arguments import parse_args
    from parm_trainer.node_relay import group_limit_note

    def note(ep, groups, world, per_node):
        args = parse_args(["--num-experts", "32", "--moe-router-topk", "8",
                           "--moe-router-num-groups", str(groups), "--moe-router-group-topk",
                           "2", "--expert-model-parallel-size", str(ep)], world_size=world)
        return group_limit_note(args, per_node)

    # node-limited (DeepSeek-V3): 4 groups on 4 nodes of 4 EP ranks each
    assert note(16, 4, 16, 4).endswith("a token's rows go to at most 2 of the 4 nodes of its "
                                       "EP group")
    # device-limited: a group per EP rank
    assert "each group on one EP rank, so a token goes to at most 2 of the 8 EP ranks" in \
        note(8, 8, 8, 8)
    # one EP rank per node, two groups of two ranks' experts each: no node bound
    assert "the groups do not line up with the 4 nodes" in note(4, 2, 4, 1)
    assert note(4, 2, 4, 4) == ("group-limited routing: 2 groups of 16 experts, 2 per token; a "
                                "group on 2 EP ranks, so a token goes to at most 4 of the 4 EP "
                                "ranks (no limit)")


def test_routing_odds_match_megatrons_group_limited_routing():
    """The cost model's chance that a token reaches a block of experts (an EP rank's, a
    node's), against megatron-core's own routing of random scores."""
    import torch
    from megatron.core.transformer.moe.moe_utils import group_limited_topk

    from parm_trainer.moe.routing_odds import hit

    tokens = 20000
    torch.manual_seed(0)
    for experts, topk, groups, group_topk, block, start in (
            (32, 8, 4, 2, 4, 0), (64, 8, 8, 4, 8, 8), (64, 6, 8, 3, 12, 4),
            (256, 8, 8, 4, 32, 0), (128, 8, 16, 4, 16, 0), (64, 8, 0, 0, 8, 0)):
        scores = torch.rand(tokens, experts)
        if group_topk:
            _, chosen = group_limited_topk(scores, topk, tokens, experts, groups, group_topk)
        else:
            chosen = scores.topk(topk, dim=1).indices
        routed = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, chosen, True)
        measured = routed[:, start:start + block].any(dim=1).float().mean().item()
        assert abs(hit(experts, topk, block, start, groups, group_topk) - measured) < 0.015, \
            (experts, topk, groups, group_topk, block, start, measured)


def test_cost_model_prices_the_shared_expert_and_routing_groups():
    """The shared expert before the gate adds its own forward and backward to the layer; where
    it overlaps the exchange, its forward costs at most that, and nothing where the link's
    first piece is longer. Group-limited routing aligned with the EP ranks: each token sends
    to exactly group-topk of them."""
    from dataclasses import replace

    from parm_trainer.moe.cost_profile import DEFAULT_PROFILE
    from parm_trainer.moe.cost_model import plan_cost, shape_plan, shared_expert_s
    from parm_trainer.moe.cost_shape import LayerShape

    shape = LayerShape(tokens=4096, hidden=1024, ffn=256, experts=64, topk=8,
                       capacity_factor=None, ep=8, exact=True, chunks=2)

    def total(**fields):
        s = replace(shape, **fields)
        return plan_cost(shape_plan("s1", s), s, DEFAULT_PROFILE)

    plain, before = total(), total(shared_ffn=2048)
    fwd, bwd = shared_expert_s(replace(shape, shared_ffn=2048), DEFAULT_PROFILE)
    assert fwd > 0 and abs(before["forward_s"] - plain["forward_s"] - fwd) < 1e-12
    assert abs(before["backward_s"] - plain["backward_s"] - bwd) < 1e-12
    overlapped = total(shared_ffn=2048, shared_overlap=True)
    assert plain["forward_s"] <= overlapped["forward_s"] < before["forward_s"]
    assert replace(shape, groups=8, group_topk=2).ep_hit() == 2 / 8
    assert replace(shape, groups=8, group_topk=2).ep_hit() < shape.ep_hit()
