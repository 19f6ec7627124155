"""The entry points check their flags before they import megatron-core
(training/user_errors.check_flags_first): a fresh Python, as a rank of a real torchrun starts,
ends with the one error line and never imports megatron (-X importtime lists every import)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT


def _rank(script, *flags, world_size=4):
    env = {**os.environ, "WORLD_SIZE": str(world_size), "RANK": "0", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-X", "importtime", script, *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script,flags,needle", [
    ("pretrain_gpt_moe.py", ["--tensor-model-parallel-size", "3", "--num-attention-heads", "6",
                             "--hidden-size", "96"], "does not divide the world size 4"),
    ("pretrain_bert_moe.py", ["--num-experts", "four"], "invalid int value: 'four'"),
])
def test_bad_flags_end_the_rank_before_megatron_is_imported(script, flags, needle):
    run = _rank(script, "--num-layers", "2", "--seq-length", "64", "--max-position-embeddings",
                "64", "--micro-batch-size", "1", *flags)
    imports = [line.split("|")[-1].strip() for line in run.stderr.splitlines()
               if line.startswith("import time:")]
    errors = [line for line in run.stderr.splitlines() if "error" in line
              and not line.startswith("import time:")]
    assert run.returncode != 0 and errors and needle in errors[-1], run.stderr[-3000:]
    assert "torch" in imports, "importtime listed nothing"
    assert not [name for name in imports if name.startswith("megatron")], "megatron was imported"
