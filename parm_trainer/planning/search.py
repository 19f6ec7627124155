"""Every layout of a cluster for one model, ranked by predicted time per iteration.

A layout is TP (inside a node), EP, ESP, PP, V (virtual stages per rank), DP (what is left),
the MoE schedule and depth (the cheapest s1/s2 and r the cost model finds for it) and the
stages (stages.split, under the memory limit as the start-up estimate counts it; where the
split without recomputation does not fit, the recompute setting of least predicted time that
does: recompute_choice.py, its flags among the candidate's). Each candidate's flags go through
the project's own checks (arguments.parse_args and planning/checks.validate_layout, with PP
checked here since the stage builder need not split layers evenly), so a ranked layout is one
that runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from parm_trainer.models.config import padded_vocab_size
from parm_trainer.planning.layout import STAGE_FLAGS
from parm_trainer.planning.model_cost import ModelCost
from parm_trainer.planning.recompute_choice import choose
from parm_trainer.planning.stages import NoSplitFits, layout_string, price_split


@dataclass
class Candidate:
    tp: int
    ep: int
    esp: int
    pp: int
    vp: int
    dp: int
    schedule: str
    layout: str
    iteration_s: float
    memory_bytes: float   # the largest over ranks
    main_cost: str        # what most of the iteration goes to
    tokens_per_s: float
    recompute: tuple = ()  # recompute flags chosen under the memory limit (recompute_choice)

    def flags(self) -> list:
        flags = ["--tensor-model-parallel-size", self.tp, "--expert-model-parallel-size", self.ep,
                 "--expert-tensor-parallel-size", self.esp,
                 "--pipeline-model-parallel-size", self.pp]
        if self.tp > 1:
            flags.append("--sequence-parallel")
        if self.pp > 1:  # P x V stages in the string: megatron reads V from it
            flags += ["--pipeline-model-parallel-layout", self.layout]
        return [str(f) for f in [*flags, *self.recompute]]


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(args, profile, nodes: int, gpus_per_node: int, vocab: int,
               memory_limit_bytes: float = None, virtual=(1, 2)) -> list:
    """Every layout that runs args' model on nodes x gpus_per_node ranks, fastest first;
    layouts over memory_limit_bytes per rank are left out."""
    from parm_trainer.arguments import ArgumentsError
    from parm_trainer.errors import LayoutError as FlagError
    from parm_trainer.planning.checks import validate_layout

    world = nodes * gpus_per_node
    found = []
    for tp in _divisors(gpus_per_node):
        for pp in _divisors(world // tp):
            for ep in _divisors(args.num_experts or 1):
                for esp in sorted({1, tp}):
                    if world % (ep * esp * pp):
                        continue
                    for vp in virtual if pp > 1 else (1,):
                        trial = _trial(args, world, tp, pp, ep, esp, vocab)
                        try:
                            validate_layout(trial)
                        except (FlagError, ArgumentsError):
                            continue
                        trial.pipeline_model_parallel_size = pp
                        dp = world // (tp * pp)
                        if trial.global_batch_size % (trial.micro_batch_size * dp):
                            continue
                        found += _priced(trial, profile, tp, ep, esp, pp, vp, dp,
                                         memory_limit_bytes)
    return sorted(found, key=lambda c: c.iteration_s)


def _trial(args, world, tp, pp, ep, esp, vocab):
    trial = copy.copy(args)
    trial.world_size = world
    trial.tensor_model_parallel_size, trial.expert_model_parallel_size = tp, ep
    trial.expert_tensor_parallel_size, trial.sequence_parallel = esp, tp > 1
    trial.pipeline_model_parallel_size = 1  # checked here: the builder splits unevenly
    for name in STAGE_FLAGS:  # the user's own stages: the builder chooses them here
        setattr(trial, name, None)
    trial.padded_vocab_size = padded_vocab_size(vocab, tp)
    return trial


def _priced(trial, profile, tp, ep, esp, pp, vp, dp, memory_limit_bytes) -> list:
    microbatches = trial.global_batch_size // (trial.micro_batch_size * dp)
    tied = not getattr(trial, "untie_embeddings_and_output_weights", False)
    costs = []

    def price(args, limit):
        costs.append(ModelCost(args, profile))
        return price_split(args, costs[-1], pp, vp, microbatches, limit, tied)

    try:  # under the limit, recomputation where the plain split does not fit
        chosen = choose(trial, price, memory_limit_bytes, NoSplitFits)
    except ValueError:  # NoSplitFits, or no MoE schedule runs the layout
        return []
    result, ranks = chosen.predicted, chosen.predicted["ranks"]
    slowest = max(r["time_s"] for r in ranks)
    parts = {"stage compute and MP/EP traffic": microbatches * slowest,
             "pipeline bubble": max(0.0, sum(result["steps_s"]) - microbatches * slowest),
             "gradient sync and optimizer": max(r["sync_s"] for r in ranks)}
    schedule = "dense" if not trial.num_experts else "/".join(costs[0].moe_choice)
    tokens = trial.global_batch_size * trial.seq_length
    recompute = tuple(chosen.setting.flags()) if chosen.setting else ()
    return [Candidate(tp, ep, esp, pp, vp, dp, schedule, layout_string(chosen.runs),
                      result["iteration_s"], chosen.memory_bytes, max(parts, key=parts.get),
                      tokens / result["iteration_s"], recompute)]
