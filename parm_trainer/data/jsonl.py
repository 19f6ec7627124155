"""Reading the jsonl corpora the data tools take (one JSON object per line), and making
the directory of their --output-prefix."""

from __future__ import annotations

import json
import os


def parse_record(path, lineno, line, keys):
    """Parse one jsonl line and check it has a string under every key."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{lineno}: invalid JSON: {err}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
    for key in keys:
        if key not in record:
            raise ValueError(f"{path}:{lineno}: missing JSON key {key!r} "
                             f"(present: {', '.join(sorted(record)) or 'none'})")
        if not isinstance(record[key], str):
            raise ValueError(f"{path}:{lineno}: JSON key {key!r} is "
                             f"{type(record[key]).__name__}, expected a string")
    return record


def iter_jsonl_texts(path, keys):
    """Yield the text under each of keys for every non-blank line of a jsonl file."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                record = parse_record(path, lineno, line, keys)
                for key in keys:
                    yield record[key]


def make_output_dir(prefix):
    """Create the directory --output-prefix writes into; ValueError naming the flag if not."""
    directory = os.path.dirname(os.path.abspath(prefix))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--output-prefix {prefix}: cannot create {directory} "
                         f"({err.strerror})") from None
