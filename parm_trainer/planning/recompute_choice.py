"""Activation recomputation chosen under --memory-gb: where the fastest split without
recomputation does not fit the limit (or only slower splits do), the stage builder
(stages.auto_layout) and tools/plan_layout.py (search.py) try Megatron-LM's recompute settings
and take the split of least predicted iteration time whose memory estimate fits
(rank_memory.py: the numbers the start-up check compares), the plain one among them.

The settings, about in order of the time they add (recompute_cost.py prices each):
    selective core_attn              the softmax and its mask again
    selective moe                    Parm's: the local experts on the rows received, no exchange
    selective core_attn moe (+ mlp)  more modules (mlp: where dense layers are)
    full block N                     the first N layers of each chunk, the least N that fits
    full uniform 1, uniform L        every layer (its input kept; L: one input per stage)
A user's own --recompute-* flags are never overridden: they are priced as given. A choice is
applied as the flags would set it (arguments/recompute.py's problem() and settle()).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional

from parm_trainer.arguments.recompute import problem, settle
from parm_trainer.planning.model_cost import moe_layers

GIB = 2 ** 30
FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers",
          "recompute_modules", "recompute_activations", "moe_layer_recompute")


@dataclass(frozen=True)
class Setting:
    granularity: str              # "selective" or "full"
    modules: tuple = ()           # selective: --recompute-modules
    method: Optional[str] = None  # full: "block" or "uniform"
    layers: Optional[int] = None  # full: --recompute-num-layers

    def flags(self) -> list:
        if self.granularity == "selective":
            return ["--recompute-granularity", "selective", "--recompute-modules",
                    *self.modules]
        return ["--recompute-granularity", "full", "--recompute-method", self.method,
                "--recompute-num-layers", str(self.layers)]

    def __str__(self) -> str:
        return " ".join(self.flags())


@dataclass
class Priced:
    """A split under one recompute setting (None: args' own)."""
    runs: list       # the chunks' pieces, megatron's chunk order (before full recompute)
    predicted: dict  # stages.predict's result under the setting
    ranks: list      # rank_memory.entries: per pipeline rank, "total" bytes and parts
    setting: Optional[Setting] = None
    plain: Optional["Priced"] = None  # a chosen setting's: the split without recomputation

    @property
    def memory_bytes(self) -> float:
        return max(r["total"] for r in self.ranks)

    @property
    def iteration_s(self) -> float:
        return self.predicted["iteration_s"]


def user_given(args) -> bool:
    """Whether the run's own flags ask for recomputation (settle() has run)."""
    return getattr(args, "recompute_granularity", None) is not None


def with_setting(args, setting: Setting):
    """A copy of args with the setting's fields as its flags would set them; None where
    arguments/recompute.problem() refuses it for this model."""
    trial = copy.copy(args)
    trial.recompute_activations = trial.moe_layer_recompute = False
    trial.recompute_granularity, trial.recompute_method = setting.granularity, setting.method
    trial.recompute_num_layers = setting.layers
    trial.recompute_modules = list(setting.modules) if setting.modules else None
    if problem(trial) is not None:
        return None
    settle(trial)
    return trial


def selective_settings(args) -> list:
    moe = moe_layers(args)
    if not any(moe):
        choices = [("core_attn",), ("core_attn", "mlp")]
    else:
        choices = [("core_attn",), ("moe",), ("core_attn", "moe")]
        if not all(moe):
            choices.append(("core_attn", "mlp", "moe"))
    return [Setting("selective", modules) for modules in choices]


def choose(args, price: Callable, limit: Optional[float], refusal=ValueError) -> Priced:
    """price(trial args, limit) -> Priced (or a ValueError: no split fits). The plain split
    where no limit is given, the run's flags ask for recompute, or the limit does not slow it
    down; else the split of least predicted time among the plain one (where one fits) and
    those under each recompute setting that fit (its .plain: the fastest split without
    recomputation, limit aside), or refusal(message) where none fits."""
    try:
        plain, error = price(args, limit), None
    except ValueError as refused:
        plain, error = None, refused
    if limit is None or user_given(args):
        if plain is None:
            raise error
        return plain
    fastest = plain if plain and plain.memory_bytes <= limit else None
    free = price(args, None) if fastest else None  # the split the limit would not bind
    if fastest and fastest.iteration_s <= free.iteration_s * (1 + 1e-9):
        return fastest
    tried, fits = [], [fastest] if fastest else []

    def attempt(setting) -> bool:
        trial = with_setting(args, setting)
        if trial is None:
            return False
        try:
            priced = price(trial, limit)
        except ValueError:
            tried.append((setting, None))
            return False
        priced.setting = setting
        tried.append((setting, priced.memory_bytes))
        if priced.memory_bytes <= limit:
            fits.append(priced)
        return priced.memory_bytes <= limit

    for setting in selective_settings(args):
        attempt(setting)
    per_stage = args.num_layers // args.pipeline_model_parallel_size
    low, high, block = 1, per_stage - 1, None  # the least N of full block N that fits
    while low <= high:
        middle = (low + high) // 2
        if attempt(Setting("full", method="block", layers=middle)):
            block, high = middle, middle - 1
        else:
            low = middle + 1
    if block is None:  # every layer recomputed: one input kept per layer, then per stage
        if not attempt(Setting("full", method="uniform", layers=1)) and per_stage > 1:
            attempt(Setting("full", method="uniform", layers=per_stage))
    if fits:
        chosen = min(fits, key=lambda p: p.iteration_s)
        if chosen.setting is not None:
            chosen.plain = free or (plain if plain and plain.memory_bytes > limit else
                                    price(args, None))
        return chosen
    least = min(((m, s) for s, m in tried if m is not None), default=None,
                key=lambda pair: pair[0])
    head = (str(error) if error is not None else
            f"no split into {len(plain.runs)} stages fits the memory limit of "
            f"{limit / GIB:.3g} GiB per rank: the best needs an estimated "
            f"{plain.memory_bytes / GIB:.3g} GiB")
    raise refusal(head + ", nor with activation recomputation (tried " +
                  (f"{len(tried)} settings; the least memory, {least[0] / GIB:.3g} GiB, with "
                   f"{least[1]})" if least else f"{len(tried)} settings)"))


def apply(args, setting: Setting) -> None:
    """Set args' recompute fields as the setting's flags would (checked as they would be)."""
    trial = with_setting(args, setting)
    if trial is None:
        raise ValueError(f"{setting}: refused by the recompute checks")
    for name in FIELDS:
        setattr(args, name, getattr(trial, name))


def describe(chosen: Priced, limit: float) -> str:
    """The log line of a chosen setting: why, memory before and after, time added."""
    plain = chosen.plain
    why = (f"the fastest split without recomputation needs an estimated "
           f"{plain.memory_bytes / GIB:.3g} GiB on its fullest rank" if plain.memory_bytes > limit
           else "without recomputation only slower splits fit")
    return (f"--memory-gb {limit / GIB:g}: {why}; recomputing activations with "
            f"{chosen.setting} (of the settings that fit, the least predicted time): "
            f"{chosen.memory_bytes / GIB:.3g} GiB, {chosen.iteration_s * 1e3:.1f} ms per "
            f"iteration, {(chosen.iteration_s - plain.iteration_s) * 1e3:.2f} ms more than "
            f"the fastest split without it")
