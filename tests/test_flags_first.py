"""The entry points check their flags before they import torch and megatron-core
(training/user_errors.check_flags_first): a fresh Python, as a rank of a real torchrun starts,
ends with the one error line and never imports either (-X importtime lists every import)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT


def _rank(script, *flags, world_size=4):
    flags = [str(flag) for flag in flags]
    env = {**os.environ, "WORLD_SIZE": str(world_size), "RANK": "0", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-X", "importtime", script, *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script,flags,needle", [
    ("pretrain_gpt_moe.py", ["--tensor-model-parallel-size", "3", "--num-attention-heads", "6",
                             "--hidden-size", "96"], "does not divide the world size 4"),
    ("pretrain_bert_moe.py", ["--num-experts", "four"], "invalid int value: 'four'"),
    ("pretrain_gpt_moe.py", ["--num-attention-heads", "4", "--hidden-size", "64", "--data-path",
                             "/nowhere/corpus_text_document", "--tokenizer-model", "README.md"],
     "/nowhere/corpus_text_document.bin not found"),
    ("pretrain_gpt_moe.py", ["--num-attention-heads", "4", "--hidden-size", "64", "--data-path",
                             "/nowhere/corpus", "--tokenizer-model", "/nowhere/t.model"],
     "--tokenizer-model /nowhere/t.model: no such file"),
])
def test_bad_flags_end_the_rank_before_torch_is_imported(script, flags, needle):
    run = _rank(script, "--num-layers", "2", "--seq-length", "64", "--max-position-embeddings",
                "64", "--micro-batch-size", "1", *flags)
    imports = [line.split("|")[-1].strip() for line in run.stderr.splitlines()
               if line.startswith("import time:")]
    errors = [line for line in run.stderr.splitlines() if "error" in line
              and not line.startswith("import time:")]
    assert run.returncode != 0 and errors and needle in errors[-1], run.stderr[-3000:]
    assert "parm_trainer.arguments" in imports, "importtime listed nothing"
    late = [name for name in imports if name.split(".")[0] in ("torch", "megatron")]
    assert not late, late[:5]


def test_good_flags_keep_megatron_imported_without_wandb_or_torch_compile(tmp_path):
    """Flags and files that pass the first checks: megatron-core is imported after them, still
    without wandb (not asked for) and without torch.compile's modules (lazy_imports.py), until
    the data set's index, empty, ends the rank (a check of initialize's, after the imports)."""
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus{suffix}").write_bytes(b"")
    run = _rank("pretrain_gpt_moe.py", "--num-layers", "2", "--hidden-size", "64",
                "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings",
                "64", "--micro-batch-size", "1", "--global-batch-size", "4", "--num-experts", "4",
                "--train-iters", "2", "--data-path", tmp_path / "corpus",
                "--tokenizer-model", tmp_path / "corpus.bin", world_size=1)
    imports = [line.split("|")[-1].strip() for line in run.stderr.splitlines()
               if line.startswith("import time:")]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error")]
    assert run.returncode == 1 and errors and "bad header magic" in errors[-1], run.stderr[-3000:]
    assert "megatron.core" in imports and "torch" in imports, "the checks ended the rank"
    late = [name for name in imports if name.startswith(("wandb.", "torch._inductor"))]
    assert not late, late[:5]
