"""Where a conversion writes: SAVE_DIR appears whole or not at all; how large its shards are.

Everything is written into SAVE_DIR.partial, renamed to SAVE_DIR only once all is written; an
existing SAVE_DIR is refused before anything is done, and a failure removes the partial one.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil


class ConvertError(ValueError):
    """Input the converter cannot use; the message names it."""


def refuse_existing(save_dir: str) -> None:
    if os.path.exists(save_dir):
        raise ConvertError(f"--save-dir {save_dir} exists; give a directory that does not")


@contextlib.contextmanager
def written_whole(save_dir: str):
    refuse_existing(save_dir)
    partial = save_dir.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.rename(partial, save_dir)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text) -> int:
    """Bytes of a size as transformers' max_shard_size takes it: 5GB (10^9), 5GiB (2^30),
    500MB, or a number of bytes. ValueError for anything else, or a size below 1."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]) if match else 0
    if size < 1:
        raise ValueError(f"--max-shard-size {text}: give a size such as 5GB, 500MB, 2GiB or a "
                         f"number of bytes")
    return size
