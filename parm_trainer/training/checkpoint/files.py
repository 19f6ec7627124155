"""A checkpoint directory's files, readable without torch or megatron (fast for the tools).

    SAVE/latest_checkpointed_iteration.txt   the iteration of the newest whole checkpoint
    SAVE/iter_0000200/                       megatron-core dist_checkpointing files, and
    SAVE/iter_0000200/run.json               the run's description: version, layout, every flag
    SAVE/iter_0000200/tokenizer.model        a copy of the tokenizer (SentencePiece, Llama2), or
    SAVE/iter_0000200/vocab.json, merges.txt copies of it (GPT-2 BPE); run.json names the type
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Optional
from parm_trainer.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
DESCRIPTION = "run.json"
TOKENIZER = "tokenizer.model"
# each tokenizer file flag (its argparse dest) -> the name of its copy in a checkpoint
TOKENIZER_FILES = {"tokenizer_model": TOKENIZER, "vocab_file": "vocab.json",
                   "merge_file": "merges.txt"}
HF_TOKENIZER = "hf_tokenizer"  # HuggingFaceTokenizer's --tokenizer-model: a directory


def tokenizer_copy(tokenizer_type, dest: str) -> str:
    """The name, in a checkpoint directory, of the copy of a tokenizer file flag's file."""
    if tokenizer_type == "HuggingFaceTokenizer" and dest == "tokenizer_model":
        return HF_TOKENIZER
    return TOKENIZER_FILES[dest]




def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number, found {text!r}")
    return int(text)


def replace_tracker(root: str, iteration: int, before_replace: Callable = lambda: None) -> None:
    """Point the tracker at iteration atomically: write a temporary file, then os.replace."""
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    before_replace()
    os.replace(tracker_tmp, os.path.join(root, TRACKER))


_ITERATION_DIR = re.compile(r"^iter_(\d{7})$")


def iterations(root: str) -> list:
    """The iterations of root's renamed (whole) directories, newest first."""
    found = [_ITERATION_DIR.match(name) for name in os.listdir(root)] if os.path.isdir(root) else []
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def strays(root: str) -> list:
    """Lines naming what interrupted saves left under root: .tmp directories (never finished)
    and directories newer than the tracker (renamed, never recorded)."""
    if not os.path.isdir(root):
        return []
    latest = read_tracker(root)
    lines = [f"ignored {os.path.join(root, name)}: left by a save that did not finish (the next "
             f"save removes it)" for name in sorted(os.listdir(root))
             if name.startswith("iter_") and name.endswith((".tmp", ".old"))]
    lines += [f"ignored {iteration_dir(root, it)}: newer than {TRACKER} ({latest}), its save "
              f"was interrupted before it was recorded" for it in iterations(root)
              if latest is not None and it > latest]
    return lines


def latest_dir(root: str) -> str:
    """The iteration directory root's tracker names; CheckpointError when there is none."""
    iteration = read_tracker(root)
    if iteration is None:
        raise CheckpointError(f"{root} is not a parm_trainer checkpoint directory "
                              f"(no {TRACKER})")
    return iteration_dir(root, iteration)


def read_description(path: str) -> dict:
    """run.json of a checkpoint directory (an iteration directory or its parent)."""
    if os.path.isfile(os.path.join(path, TRACKER)):
        iteration = read_tracker(path)
        path = iteration_dir(path, iteration)
    file = os.path.join(path, DESCRIPTION)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} is not a parm_trainer checkpoint (no {DESCRIPTION})")
    return json.load(open(file))
