"""The data the tests train on, built once a session with the project's own tools: a corpus of
standard-library prose, a SentencePiece tokenizer and a GPT-2 byte-level BPE, indexed datasets
for GPT (documents) and BERT (sentences). Registered by conftest.py (pytest_plugins)."""

from __future__ import annotations

import json

import pytest

from conftest import run_tool


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory):
    """A 400 KB corpus of standard-library prose, a 2000-piece tokenizer, an indexed dataset."""
    out = tmp_path_factory.mktemp("gpt_data")
    run_tool("tools/make_demo_corpus.py", "--output", out / "corpus.jsonl", "--max-bytes", 400_000)
    run_tool("tools/train_tokenizer.py", "--input", out / "corpus.jsonl", "--json-keys", "text",
             "--output-prefix", out / "tokenizer", "--vocab-size", 2000)
    run_tool("tools/preprocess_data.py", "--input", out / "corpus.jsonl", "--json-keys", "text",
             "--output-prefix", out / "corpus", "--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", out / "tokenizer.model", "--append-eod", "--workers", 1)
    return {"dir": out, "prefix": str(out / "corpus_text_document"),
            "tokenizer": str(out / "tokenizer.model")}


@pytest.fixture(scope="session")
def gpt2_data(gpt_data):
    """The GPT tests' corpus under a GPT-2 byte-level BPE made here (the `tokenizers` library
    writes vocab.json and merges.txt, as Megatron-LM's GPT-3 recipe reads them)."""
    from tokenizers import ByteLevelBPETokenizer

    out = gpt_data["dir"] / "gpt2"
    out.mkdir()
    texts = [json.loads(line)["text"] for line in open(gpt_data["dir"] / "corpus.jsonl")]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=1000, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(out))
    files = {"vocab_file": str(out / "vocab.json"), "merge_file": str(out / "merges.txt")}
    run_tool("tools/preprocess_data.py", "--input", gpt_data["dir"] / "corpus.jsonl",
             "--json-keys", "text", "--output-prefix", out / "corpus", "--vocab-file",
             files["vocab_file"], "--merge-file", files["merge_file"], "--append-eod",
             "--workers", 1)
    return {**files, "prefix": str(out / "corpus_text_document")}


@pytest.fixture(scope="session")
def bert_data(gpt_data):
    """The GPT tests' corpus and tokenizer, one sequence per sentence."""
    out = gpt_data["dir"]
    run_tool("tools/preprocess_data.py", "--input", out / "corpus.jsonl", "--json-keys", "text",
             "--output-prefix", out / "bert", "--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", gpt_data["tokenizer"], "--split-sentences", "--workers", 1)
    return {**gpt_data, "prefix": str(out / "bert_text_sentence")}


@pytest.fixture(scope="session")
def hf_dir(gpt_data, tmp_path_factory):
    """A byte-level BPE (the `tokenizers` library) on the GPT corpus, as the Hugging Face
    families ship theirs: tokenizer.json whose post-processor puts <s> before a text, eos
    <|endoftext|>, saved by transformers beside a stand-in model file."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
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
