"""tools/checkpoint/convert.py streaming, and carrying a Hugging Face tokenizer (tokenizer.json).

A Mixtral saved by transformers in shards with model.safetensors.index.json, beside a byte-level
BPE tokenizer.json (data_fixtures.py hf_dir, no tokenizer.model) imports as a checkpoint that
carries the tokenizer (HuggingFaceTokenizer: run.json and the printed command line name the
copy); tools/generate.py continues a prompt from it with transformers' ids and transformers'
greedy tokens; it exports back in shards, bit for bit, with the tokenizer AutoTokenizer reads
alike and its bos/eos in config.json and generation_config.json. A larger Mixtral (8 shards)
converts both ways with the peak resident memory of the converting process within 2.5 of its
largest shard above the same process without a model (its imports done). Which tokenizer an
import carries where a directory holds tokenizer.model, tokenizer.json or both. Refusals are one
line.
"""

import json
import os
import re
import shutil
import warnings

import torch

from conftest import free_port, python, torchrun
from bad_input_fixtures import assert_refused
from test_tokenizers import PROMPT, TEXTS

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from safetensors import safe_open
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def convert(*args, timeout=300):
    return python("tools/checkpoint/convert.py", *args, timeout=timeout)


def _mixtral(directory, tokenizer_dir, max_shard_size, **sizes):
    """A random Mixtral of the tokenizer's vocabulary, saved by transformers in shards, with the
    tokenizer's files (not the stand-in model file beside them)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = {**dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_local_experts=4), **sizes}
    config = MixtralConfig(vocab_size=len(tokenizer), num_attention_heads=4,
                           num_key_value_heads=2, num_experts_per_tok=2,
                           max_position_embeddings=64, rope_theta=10000.0,
                           bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id, **shape)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, directory / name)
    return model, tokenizer


def _weights(directory) -> dict:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(str(directory / name), "pt") as f:
                out.update({key: f.get_tensor(key) for key in f.keys()})
    return out


def _assert_same_weights(original, back):
    a, b = _weights(original), _weights(back)
    assert sorted(a) == sorted(b)
    for key, tensor in a.items():
        assert torch.equal(tensor, b[key]), key
    index = json.load(open(back / "model.safetensors.index.json"))["weight_map"]
    assert sorted(index) == sorted(b)


def test_hf_tokenizer_imports_generates_and_exports(hf_dir, tmp_path):
    original, imported, back = tmp_path / "original", tmp_path / "imported", tmp_path / "back"
    model, tokenizer = _mixtral(original, hf_dir, "100KB")
    assert not (original / "tokenizer.model").exists()
    assert len([n for n in os.listdir(original) if n.endswith(".safetensors")]) > 2

    result = convert("--loader", "hf", "--saver", "parm", "--load-dir", original,
                     "--save-dir", imported)
    assert result.returncode == 0, result.stderr[-3000:]
    copy = imported / "iter_0000000" / "hf_tokenizer"
    assert (f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {copy} "
            f"--load {imported}") in result.stdout
    saved = json.load(open(imported / "iter_0000000" / "run.json"))["args"]
    assert saved["tokenizer_type"] == "HuggingFaceTokenizer"
    assert (copy / "tokenizer.json").is_file() and not (copy / "model.safetensors").exists()

    status, output = torchrun(["--nproc-per-node", 1, "--master-port", free_port(),
                               "tools/generate.py", "--load-dir", imported, "--prompt", PROMPT,
                               "--max-new-tokens", 8])
    assert status == 0, output[-3000:]
    lines = output.splitlines()
    prompt_ids = [int(i) for i in next(l for l in lines if l.startswith("prompt ids: ")).split()[2:]]
    ours = [int(i) for i in next(l for l in lines if l.startswith("ids: ")).split()[1:]]
    assert prompt_ids == tokenizer(PROMPT).input_ids
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    assert ours == theirs[0, len(prompt_ids):].tolist()

    result = convert("--loader", "parm", "--saver", "hf", "--load-dir", imported,
                     "--save-dir", back, "--max-shard-size", "100KB")
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_weights(original, back)
    exported = AutoTokenizer.from_pretrained(back)
    for text in TEXTS:
        assert exported(text).input_ids == tokenizer(text).input_ids, text
    for name in ("config.json", "generation_config.json"):
        config = json.load(open(back / name))
        assert (config["bos_token_id"], config["eos_token_id"]) == (
            tokenizer.bos_token_id, tokenizer.eos_token_id), name

    # a checkpoint whose tensors are not the model its run.json describes: refused, before
    # anything is written
    wrong = tmp_path / "wrong"
    shutil.copytree(imported, wrong)
    description = json.load(open(wrong / "iter_0000000" / "run.json"))
    description["args"]["moe_ffn_hidden_size"] = 48
    json.dump(description, open(wrong / "iter_0000000" / "run.json", "w"))
    result = convert("--loader", "parm", "--saver", "hf", "--load-dir", wrong,
                     "--save-dir", tmp_path / "out")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert "does not fit the model its run.json describes" in errors[0], errors[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def _peak(mode, modules, *flags):
    """(status, peak KiB, output) of tests/worker_peak_memory.py in a process of its own."""
    run = python("tests/worker_peak_memory.py", mode, modules, "--", *flags, timeout=400)
    found = re.search(r"^peak_kib (\d+)$", run.stdout, re.MULTILINE)
    assert found, run.stdout[-2000:] + run.stderr[-3000:]
    return run.returncode, int(found.group(1)), run.stdout + run.stderr


def test_streaming_peak_memory(hf_dir, tmp_path):
    """Both ways, the converting process's peak resident memory stays within 2.5 of the largest
    shard above its baseline: the same process with the conversion's modules imported and no
    model. The model is 8 such shards: holding it whole would pass the bound three times over."""
    original, imported, back = tmp_path / "original", tmp_path / "imported", tmp_path / "back"
    _mixtral(original, hf_dir, "60MB", hidden_size=256, intermediate_size=2048,
             num_hidden_layers=8, num_local_experts=8)
    shards = [original / n for n in os.listdir(original) if n.endswith(".safetensors")]
    largest = max(os.path.getsize(shard) for shard in shards) // 1024
    assert len(shards) >= 6
    figures = {}
    for way, flags in (("import", ("--loader", "hf", "--saver", "parm", "--load-dir", original,
                                   "--save-dir", imported)),
                       ("export", ("--loader", "parm", "--saver", "hf", "--load-dir", imported,
                                   "--save-dir", back, "--max-shard-size", "60MB"))):
        modules = tmp_path / f"{way}_modules.json"
        status, peak, output = _peak("convert", modules, *flags)
        assert status == 0, output[-3000:]
        _, baseline, _ = _peak("baseline", modules)
        figures[way] = (peak, baseline)
    statement = "; ".join(
        f"{way}: peak {peak / 1024:.0f} MiB, baseline {baseline / 1024:.0f} MiB, above it "
        f"{(peak - baseline) / 1024:.0f} MiB = {(peak - baseline) / largest:.2f} x the largest "
        f"shard ({largest / 1024:.1f} MiB of {sum(map(os.path.getsize, shards)) / 2**20:.0f})"
        for way, (peak, baseline) in figures.items())
    print(statement)
    for way, (peak, baseline) in figures.items():
        assert peak - baseline < 2.5 * largest, statement
    _assert_same_weights(original, back)


def test_convert_tokenizer_refusals(entry, hf_dir, tmp_path, capsys):
    main = entry("tools/checkpoint/convert.py")
    out = tmp_path / "out"
    small = tmp_path / "small_vocab"
    small.mkdir()
    config = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    (small / "config.json").write_text(json.dumps(config))
    only_config = tmp_path / "only_tokenizer_config"
    only_config.mkdir()
    (only_config / "tokenizer_config.json").write_text("{}")
    bert = tmp_path / "bert_hf_ckpt"
    (bert / "iter_0000002").mkdir(parents=True)
    (bert / "latest_checkpointed_iteration.txt").write_text("2")
    (bert / "iter_0000002" / "run.json").write_text(json.dumps(
        {"model": "bert", "args": {"tokenizer_type": "HuggingFaceTokenizer"}}))
    hf = ["--loader", "hf", "--saver", "parm", "--load-dir", small, "--save-dir", out]
    for argv, status, needles in [
        (hf + ["--tokenizer-type", "HuggingFaceTokenizer"], 1,
         [f"{small} holds no tokenizer.json: HuggingFaceTokenizer converts a fast tokenizer"]),
        (hf + ["--tokenizer-model", only_config], 1,
         [f"{only_config} holds no tokenizer.json"]),
        (hf + ["--tokenizer-model", hf_dir], 1,
         [f"the tokenizer {hf_dir} has ", "more than the model's 64 embedding rows"]),
        (hf + ["--tokenizer-model", tmp_path / "nothing"], 1,
         [f"--tokenizer-model {tmp_path}/nothing: no such file or directory"]),
        (hf + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", hf_dir], 1,
         [f"--tokenizer-model {hf_dir} is a directory: give its tokenizer.model"]),
        (hf + ["--tokenizer-type", "GPT2BPETokenizer"], 2,
         ["argument --tokenizer-type: invalid choice: 'GPT2BPETokenizer'"]),
        (hf + ["--max-shard-size", "5XB"], 1,
         ["--max-shard-size 5XB: give a size such as 5GB, 500MB, 2GiB or a number of bytes"]),
        (hf + ["--max-shard-size", "0"], 1, ["--max-shard-size 0: give a size"]),
        (["--loader", "parm", "--saver", "hf", "--load-dir", bert, "--save-dir", out], 1,
         ["a BERT exports with a SentencePiece tokenizer only"]),
    ]:
        assert_refused(main, argv, capsys, status, *needles)
        assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_which_tokenizer_an_import_carries(gpt_data, hf_dir, tmp_path):
    """A directory with tokenizer.model and tokenizer.json (as transformers saves a
    SentencePiece model's, and this project's exports) imports SentencePiece, unless
    --tokenizer-type HuggingFaceTokenizer; with tokenizer.json alone, HuggingFaceTokenizer."""
    from parm_trainer.convert.tokenizer_files import choose, padded_rows

    both, json_only = tmp_path / "both", tmp_path / "json_only"
    for directory in (both, json_only):
        directory.mkdir()
        for name in TOKENIZER_FILES:
            if (hf_dir / name).exists():
                shutil.copyfile(hf_dir / name, directory / name)
    shutil.copyfile(gpt_data["tokenizer"], both / "tokenizer.model")
    sentencepiece = choose(str(both), None, None)
    assert (sentencepiece.kind, sentencepiece.path) == ("SentencePieceTokenizer",
                                                        str(both / "tokenizer.model"))
    assert sentencepiece.size == 2000 and padded_rows(sentencepiece, 2000) == (2048, 128)
    # more rows than the padding gives (Qwen3's case): the rows, and the multiple that gives them
    assert padded_rows(sentencepiece, 2056) == (2056, 2056)
    for directory, kind in ((both, "HuggingFaceTokenizer"), (json_only, None)):
        chosen = choose(str(directory), None, kind)
        reference = AutoTokenizer.from_pretrained(hf_dir)
        assert (chosen.kind, chosen.path) == ("HuggingFaceTokenizer", str(directory))
        assert (chosen.size, chosen.bos, chosen.eos) == (
            len(reference), reference.bos_token_id, reference.eos_token_id)
