"""--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (Megatron-LM's type).

A tokenizer made the way the Hugging Face MoE families ship theirs (data_fixtures.py hf_dir: a
byte-level BPE in tokenizer.json whose post-processor puts bos before a text, Llama's habit, eos
as <|endoftext|>, saved by transformers beside a stand-in model file). Its ids are
transformers' AutoTokenizer's (on test_tokenizers.TEXTS: 20 texts, non-ASCII among them); it
preprocesses, trains a 2-rank MoE run whose checkpoint carries the tokenizer's files (not the
model file beside them), and generates with no tokenizer flag. Conversion with it:
test_convert_stream.py.
"""

import json
import warnings

import numpy

from conftest import free_port, launch, python, tiny_gpt_args, torchrun
from parm_trainer.data.tokenizer import build_tokenizer
from test_tokenizers import PROMPT, TEXTS

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers import AutoTokenizer


def test_ids_are_autotokenizers(hf_dir):
    ours = build_tokenizer("HuggingFaceTokenizer", str(hf_dir))
    theirs = AutoTokenizer.from_pretrained(str(hf_dir))
    for text in TEXTS:
        assert ours.tokenize(text) == theirs(text).input_ids, text
        assert ours.tokenize(text)[0] == theirs.bos_token_id  # the post-processor's bos
    assert (ours.eod, ours.vocab_size) == (theirs.eos_token_id, len(theirs))
    assert ours.detokenize(ours.tokenize("Hello, world!")[1:]) == "Hello, world!"


def test_preprocesses_trains_and_generates(gpt_data, hf_dir, tmp_path):
    reference = AutoTokenizer.from_pretrained(str(hf_dir))
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir]
    prefix = tmp_path / "hf"
    result = python("tools/preprocess_data.py", "--input", gpt_data["dir"] / "corpus.jsonl",
                    "--json-keys", "text", "--output-prefix", prefix, "--append-eod",
                    "--workers", "1", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    first = json.loads(open(gpt_data["dir"] / "corpus.jsonl").readline())["text"]
    expected = reference(first).input_ids + [reference.eos_token_id]
    tokens = numpy.fromfile(f"{prefix}_text_document.bin", dtype=numpy.uint16)  # < 65500 ids
    assert tokens[:len(expected)].tolist() == expected

    ckpt = tmp_path / "ckpt"
    run = launch(2, tiny_gpt_args({"prefix": f"{prefix}_text_document", "tokenizer": None}, **{
        "tokenizer-type": "HuggingFaceTokenizer", "tokenizer-model": hf_dir,
        "expert-model-parallel-size": 2, "train-iters": 2, "save": ckpt}), tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    copy = ckpt / "iter_0000002" / "hf_tokenizer"
    assert (copy / "tokenizer.json").is_file() and not (copy / "model.safetensors").exists()

    status, output = torchrun(["--nproc-per-node", 1, "--master-port", free_port(),
                               "tools/generate.py", "--load-dir", ckpt, "--prompt", PROMPT,
                               "--max-new-tokens", 4])
    assert status == 0, output[-3000:]
    prompt_ids = next(line for line in output.splitlines() if line.startswith("prompt ids: "))
    assert [int(i) for i in prompt_ids.split()[2:]] == reference(PROMPT).input_ids
