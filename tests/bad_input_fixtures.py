"""What the in-process bad-input tests share: an entry point's main(argv) run as one rank
would run it, stopped where it would reach the process groups; files that are not what their
flag wants; the check of the one `error` line. Registered by conftest.py (pytest_plugins)."""

import json
import os

import pytest

import parm_trainer.compat.cpu
import parm_trainer.parallel
import parm_trainer.training.initialize as initialize
from conftest import load_module as _load
from parm_trainer import lazy_imports
from parm_trainer.training import watchdog


class ReachedCommunication(AssertionError):
    """The input got past every check: nothing refused it."""


@pytest.fixture
def entry(monkeypatch):
    """main(argv) of an entry point, as one rank of a job of WORLD_SIZE ranks would run it."""
    def reached(*args, **kwargs):
        raise ReachedCommunication("the input was not refused before the process groups")

    def exit_now(status):  # user_errors ends the rank with os._exit(1)
        raise SystemExit(status)

    monkeypatch.setattr(parm_trainer.compat.cpu, "apply", lambda: None)
    monkeypatch.setattr(parm_trainer.parallel, "initialize_distributed", reached)
    monkeypatch.setattr(initialize, "initialize_distributed", reached)
    monkeypatch.setattr(watchdog, "stop_helpers", lambda: None)
    monkeypatch.setattr(os, "_exit", exit_now)
    # importing an entry script would hide wandb from the rest of this pytest process
    monkeypatch.setattr(lazy_imports, "skip_wandb_unless_asked", lambda argv: None)
    for name in ("RANK", "PARM_FAULT"):
        monkeypatch.delenv(name, raising=False)

    def load(path, world_size=1):
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        if path == "tools/generate.py":
            from parm_trainer.generation import main
            return main
        return _load(path, path.replace("/", "_").removesuffix(".py")).main
    return load


def assert_refused(main, argv, capsys, status, *needles):
    """main(argv) ends with `status` and one line saying `error`, naming every needle."""
    with pytest.raises(SystemExit) as ended:
        result = main([str(a) for a in argv])
        raise SystemExit(result)  # convert.py returns its status
    code, stderr = ended.value.code, capsys.readouterr().err
    if isinstance(code, str):  # sys.exit("error: ..."): Python prints it, the status is 1
        code, stderr = 1, stderr + code + "\n"
    assert code == status, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("error")
             or ": error: " in line]  # argparse: "PROG: error: ..."
    assert len(lines) == 1, stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in stderr, stderr[-3000:]


@pytest.fixture(scope="module")
def junk(tmp_path_factory):
    """Files that are not what their flag wants."""
    root = tmp_path_factory.mktemp("junk")
    (root / "garbage.model").write_text("not a sentencepiece model\n")
    (root / "not_json.json").write_text("{not json")
    (root / "blank.jsonl").write_text("\n  \n\n")
    (root / "binary.jsonl").write_bytes(b'{"text": "\xc8\xff\xfe"}\n')
    (root / "one.jsonl").write_text(json.dumps({"text": "One short document."}) + "\n")
    tracker = root / "bad_tracker"
    tracker.mkdir()
    (tracker / "latest_checkpointed_iteration.txt").write_text("not-a-number")
    for name, model, args in (("bert_ckpt", "bert", {}), ("no_tokenizer_ckpt", "gpt", {}),
                              ("no_vocab_ckpt", "gpt", {"tokenizer_type": "GPT2BPETokenizer"})):
        (root / name / "iter_0000002").mkdir(parents=True)
        (root / name / "latest_checkpointed_iteration.txt").write_text("2")
        (root / name / "iter_0000002" / "run.json").write_text(
            json.dumps({"model": model, "args": args}))
    # GPT-2 BPE files: a vocabulary without <|endoftext|>, one whose tokens do not hold the
    # join of the merge "a b"
    (root / "vocab_no_eod.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    (root / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "<|endoftext|>": 2}))
    (root / "merges.txt").write_text("#version: 0.2\na b\n")
    return root


def pretrain_argv(data, *flags):
    return ["--data-path", data["prefix"], "--tokenizer-model", data["tokenizer"],
            "--disable-bias-linear", "--num-experts", "4", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--moe-parm-schedule", "s1", "--moe-parm-chunks", "1", *flags]
