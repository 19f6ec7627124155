"""--moe-parm-schedule auto: pick S1 or S2 once at start-up, with the cost model from a given
--moe-parm-cost-profile, or else by measuring the candidates (tune.py).

The layer shape comes from the flags (tokens per MP group = --seq-length x --micro-batch-size)
and the cluster from --moe-parm-cost-profile (a JSON profile; see cost_profile.Profile) or,
without one, cost_profile.DEFAULT_PROFILE, whose numbers are assumed A100 figures, not
measurements; the log says which was used and the predicted time of each candidate.
"""

from __future__ import annotations

from dataclasses import replace

from parm_trainer.moe.cost_model import CHUNK_CHOICES, price_schedules
from parm_trainer.moe.cost_profile import load_profile, profile_source
from parm_trainer.moe.cost_shape import layer_shape
from parm_trainer.moe_flags import shared_experts_recomputed
from parm_trainer.planning.checks import local_first_applies

TUNE_DEPTHS = (1, 2, 4)
LOCAL_FIRST_DEPTH = 2  # the depth at which start-up also times --moe-parm-local-first


def weighed_depths(args, choices) -> list:
    """The (depth, local first) pairs auto weighs: each of `choices` (or the depth given) with
    --moe-parm-local-first as given, and, where auto picks the depth and local first applies,
    LOCAL_FIRST_DEPTH with it too."""
    local, auto_chunks = bool(getattr(args, "moe_parm_local_first", False)), \
        args.moe_parm_chunks == 0
    out = [(r, local) for r in (choices if auto_chunks else (args.moe_parm_chunks,))]
    if auto_chunks and not local and local_first_applies(args):
        out.append((LOCAL_FIRST_DEPTH, True))
    return out


def label(name: str, r: int, local: bool) -> str:
    """A candidate as the log and the tune cache name it: "s1 r=2", "s1 r=2 local first"."""
    return f"{name} r={r}" + (" local first" if local else "")


def resolve_auto_schedule(args, log=print) -> None:
    """With --moe-parm-cost-profile: replace args.moe_parm_schedule "auto" by the cheaper of
    s1 and s2, and --moe-parm-chunks 0 by the cheapest pipeline depth of CHUNK_CHOICES (for s1
    and s2; the other schedules do not pipeline), and say why. Without one, leave both to be
    measured at start-up (args.moe_parm_tune_candidates, resolved by tune.tune_at_startup once
    the process groups exist; with one MP rank s1 alone: s2 then runs the same collectives and
    work, and timing both spent start-up seconds on a coin toss between them). A given profile
    is checked whatever the schedule, so a bad one never goes unnoticed."""
    profile = load_profile(args)
    auto_schedule, auto_chunks = args.moe_parm_schedule == "auto", args.moe_parm_chunks == 0
    names = ("s1", "s2") if auto_schedule else (args.moe_parm_schedule,)
    if not args.num_experts or not (auto_schedule or auto_chunks) or \
            not set(names) <= {"s1", "s2"}:
        if auto_chunks:
            args.moe_parm_chunks = 1
        return
    if not args.moe_parm_cost_profile:  # measured at start-up instead (tune.py)
        if args.tensor_model_parallel_size == 1:  # no MP to pause: s1 and s2 run alike
            names = names[:1]
        args.moe_parm_tune_candidates = [(n, r, local) for n in names
                                         for r, local in weighed_depths(args, TUNE_DEPTHS)]
        return
    shape = layer_shape(args)
    predicted = {}
    for r, local in weighed_depths(args, CHUNK_CHOICES):
        priced = price_schedules(replace(shape, chunks=r, local_first=local), profile, names)
        for name, seconds in priced.items():
            if seconds is not None:
                predicted[(name, r, local)] = seconds
    if not predicted:
        raise ValueError(f"no schedule among {names} can run this layer")
    name, r, local = min(predicted, key=predicted.get)
    source = profile_source(args, profile)
    times = ", ".join(f"{label(*c) if auto_chunks else c[0]} {t * 1e3:.3f} ms"
                      for c, t in predicted.items())
    what = " and ".join(w for w, on in (("--moe-parm-schedule auto", auto_schedule),
                                         ("--moe-parm-chunks 0", auto_chunks)) if on)
    overlap = ""
    if shape.shared_ffn and not shape.shared_overlap and not shared_experts_recomputed(args):
        # the shared expert's place, priced
        chosen = replace(shape, chunks=r, local_first=local)
        before, overlapped = (price_schedules(replace(chosen, shared_overlap=o), profile,
                                              [name])[name] for o in (False, True))
        args.moe_shared_expert_overlap = overlapped < before
        times += (f"; {label(name, r, local)} with the shared expert before the gate "
                  f"{before * 1e3:.3f} ms, overlapped with the exchange {overlapped * 1e3:.3f} ms")
        overlap = " --moe-shared-expert-overlap" if overlapped < before else ""
    log(f"{what}: predicted forward+backward per MoE layer {times} with {source}; using "
        f"{name}" + (f" with --moe-parm-chunks {r}" if auto_chunks else "")
        + (" --moe-parm-local-first" if local else "") + overlap)
    args.moe_parm_schedule, args.moe_parm_chunks = name, r
    args.moe_parm_local_first = local
