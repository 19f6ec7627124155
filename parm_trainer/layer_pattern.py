"""--moe-layer-freq: which layers are MoE, as Megatron-LM reads the flag.

    moe_layer_freq("([0]+[1]*7)")   # argparse's type: an int N, or a list of 1s and 0s
    moe_layer_pattern(freq, 8)       # one 0/1 per layer (1 = MoE)
"""

from __future__ import annotations

import argparse
import math


def moe_layer_pattern(freq, num_layers: int) -> list:
    """--moe-layer-freq as one 0/1 per layer (1 = MoE): an int N makes layers i with
    i % N == 0 MoE (megatron's integer frequency); a list is the pattern itself."""
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(num_layers)]
    return [int(bool(v)) for v in freq]


_PATTERN_LIMIT = 1_000_000  # entries a --moe-layer-freq expression may build


def moe_layer_freq(text) -> "int | list":
    """--moe-layer-freq as Megatron-LM reads it: an int N, or a list expression of 1s and 0s
    built from [..], + and * (evaluated on its syntax tree, not by eval, so nothing but lists
    and whole numbers can appear)."""
    import ast

    text = str(text).replace(" ", "")
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is neither a number nor a list such as '[1,0,1,0]' or "
                f"'([0]+[1]*7)'") from None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) for e in node.elts):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and type(left) is type(right):
                result = left + right
            elif isinstance(node.op, ast.Mult) and not (isinstance(left, list)
                                                        and isinstance(right, list)):
                size = math.prod(len(x) if isinstance(x, list) else x for x in (left, right))
                if size > _PATTERN_LIMIT:
                    raise ValueError("too long")
                result = left * right
            else:
                raise ValueError(type(node.op).__name__)
            return result
        raise ValueError(type(node).__name__)

    try:
        pattern = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        pattern = None
    if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of 1s (MoE) and 0s (dense layers) built from [..], + "
            f"and *, e.g. '([0]+[1]*7)'")
    return pattern
