"""Flags from values and back: the flags that define a model (what a checkpoint's run.json
gives the tools that rebuild it) and the command line that gives a set of values."""

from __future__ import annotations

import argparse

from parm_trainer.arguments.flags import build_parser
from parm_trainer.layer_pattern import moe_layer_freq


def model_argument_names() -> set:
    """The flags (as attribute names) that define a model and its tokenizer: what a checkpoint's
    run.json gives the tools that rebuild it. The MoE schedule flags are not among them."""
    parser = build_parser()
    names = {"tokenizer_type"}
    for group in parser._action_groups:
        if group.title in ("model", "multi-latent attention", "multi-token prediction",
                           "mixture of experts"):
            names |= {action.dest for action in group._group_actions}
    return {name for name in names if not name.startswith("moe_parm")}


def command_line(values: dict, extra_args_provider=None) -> list:
    """The flags that give these attribute values (those that differ from the defaults)."""
    flags = []
    for action in build_parser(extra_args_provider)._actions:
        if action.dest not in values or not action.option_strings:
            continue
        value, option = values[action.dest], action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            flags += [option] if value else []
        elif isinstance(action, argparse._StoreFalseAction):
            flags += [] if value else [option]
        elif action.type is moe_layer_freq and isinstance(value, list):  # as the parser reads it
            flags += [option, "[" + ",".join(map(str, value)) + "]"]
        elif value is not None and value != action.default:
            flags += [option, str(value)]
    return flags
