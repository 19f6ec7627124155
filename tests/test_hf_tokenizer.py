"""--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR (Megatron-LM's type).

A tokenizer made here the way the Hugging Face MoE families ship theirs: a byte-level BPE in
tokenizer.json whose post-processor puts bos before a text (Llama's habit), eos as
<|endoftext|>, saved by transformers beside a stand-in model file. Its ids are transformers'
AutoTokenizer's; it preprocesses, trains a 2-rank MoE run whose checkpoint carries the
tokenizer's files (not the model file beside them), and generates with no tokenizer flag.
"""

import json
import warnings

import numpy
import pytest

from conftest import free_port, launch, python, tiny_gpt_args, torchrun
from parm_trainer.data.tokenizer import build_tokenizer
from test_tokenizers import PROMPT, TEXTS

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast


@pytest.fixture(scope="module")
def hf_dir(gpt_data, tmp_path_factory):
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import TemplateProcessing

    out = tmp_path_factory.mktemp("hf_tokenizer")
    texts = [json.loads(line)["text"] for line in open(gpt_data["dir"] / "corpus.jsonl")]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=800, min_frequency=2,
                            special_tokens=["<|endoftext|>", "<s>"], show_progress=False)
    bpe.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", bpe.token_to_id("<s>"))])
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>",
                            eos_token="<|endoftext|>").save_pretrained(out)
    (out / "model.safetensors").write_bytes(b"\0" * 4096)  # a model's weights beside it
    return out


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
