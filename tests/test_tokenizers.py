"""python -m pytest -q tests/test_tokenizers.py

Megatron-LM's tokenizer types (--tokenizer-type) and what each gives:

- GPT2BPETokenizer on a byte-level BPE vocabulary made here (the `tokenizers` library trains
  it on standard-library docstrings and writes vocab.json and merges.txt) gives transformers'
  GPT2TokenizerFast's ids on 20 varied texts; that vocabulary preprocesses, trains a short MoE
  run on 2 ranks that saves a checkpoint carrying vocab.json and merges.txt, and generates from
  it with no tokenizer flag (the one test here that starts processes).
- Llama2Tokenizer on a model of tools/train_tokenizer.py (the demo's kind) gives the ids
  Megatron-LM's _Llama2Tokenizer states: sentencepiece's, after bos; eod is eos.
- NullTokenizer reads space-separated ids; its eod is --vocab-size.
- Without --tokenizer-type, --vocab-file with --merge-file means GPT2BPETokenizer (Megatron-LM's
  GPT-3 recipe names no type), anything else SentencePieceTokenizer.
"""

import importlib
import inspect
import json
import warnings

import pytest
import sentencepiece

from conftest import free_port, launch, load_module, python, tiny_gpt_args, torchrun
from parm_trainer.arguments import parse_args
from parm_trainer.data.tokenizer import GPT2_EOD, build_tokenizer
from parm_trainer.errors import TokenizerError
from parm_trainer.training import checkpoint_args

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron.core: optional GPU extensions missing
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import GPT2TokenizerFast

MODULES = ["argparse", "collections", "csv", "datetime", "email.message", "functools",
           "heapq", "inspect", "itertools", "json", "logging", "pathlib", "shutil", "string",
           "subprocess", "tempfile", "textwrap", "threading", "typing", "unittest"]
TEXTS = [
    "", "Hello, world!", "  two leading spaces", "trailing spaces   ", "   ",
    "tabs\tand\nnewlines\n\n", "\r\nWindows\r\nline endings\r\n", "x", "a" * 300,
    "naïve café — “quotes” ✓", "日本語のテキストです", "emoji 🙂🚀 and a ZWJ 👩‍💻",
    "mixed: Ελληνικά, русский, العربية, עברית", "digits 1234567890 3.14159 -42 1e-9",
    "punctuation!?.,;:'\"()[]{}<>/\\|@#$%^&*_+=~`",
    "contractions: it's don't we'll I'm they've she'd you're IT'S",
    "CamelCase snake_case kebab-case SHOUTING", "    def f(x):\n        return x ** 2\n",
    "URL https://example.com/path?q=1&r=2#frag",
    "combining e\u0301, precomposed é, NBSP\u00a0here, zero\u200bwidth",
]
PROMPT = "The function returns"


def documents() -> list:
    """Docstrings of standard-library modules and their members: about 200 KB of prose."""
    docs = []
    for name in MODULES:
        module = importlib.import_module(name)
        for obj in [module, *vars(module).values()]:
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= 100 and doc not in docs:
                docs.append(doc)
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizers")
    docs = documents()
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    return {"dir": out, "docs": docs, "jsonl": out / "corpus.jsonl"}


@pytest.fixture(scope="module")
def gpt2_files(corpus):
    """vocab.json and merges.txt of a 1000-token byte-level BPE with <|endoftext|>."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus["docs"], vocab_size=1000, min_frequency=2,
                            special_tokens=[GPT2_EOD], show_progress=False)
    bpe.save_model(str(corpus["dir"]))
    return {"vocab_file": str(corpus["dir"] / "vocab.json"),
            "merge_file": str(corpus["dir"] / "merges.txt")}


@pytest.fixture(scope="module")
def reference(gpt2_files, corpus):
    """transformers' GPT-2 tokenizer read from the same two files."""
    return GPT2TokenizerFast.from_pretrained(str(corpus["dir"]))


def test_gpt2_bpe_ids_are_transformers(gpt2_files, reference):
    tokenizer = build_tokenizer("GPT2BPETokenizer", **gpt2_files)
    vocab = json.load(open(gpt2_files["vocab_file"], encoding="utf-8"))
    assert len(reference) == tokenizer.vocab_size == len(vocab) == 1000
    assert tokenizer.eod == vocab[GPT2_EOD] == reference.eos_token_id
    for text in TEXTS:
        ids = tokenizer.tokenize(text)
        assert ids == reference(text)["input_ids"], text
        assert tokenizer.detokenize(ids) == text
    # Megatron-LM's GPT-2 tokenizer has no special tokens: <|endoftext|> in a text is
    # characters, as transformers splits it when asked to
    text = f"one{GPT2_EOD}two"
    assert tokenizer.tokenize(text) == reference(text, split_special_tokens=True)["input_ids"]
    assert tokenizer.eod not in tokenizer.tokenize(text)


def test_gpt2_merges_are_read_as_megatron_does(gpt2_files, tmp_path):
    """Megatron-LM skips merges.txt's first line (the '#version' header) whatever it holds."""
    lines = open(gpt2_files["merge_file"], encoding="utf-8").read().split("\n")
    first = lines[1].split()
    headless = tmp_path / "merges.txt"
    headless.write_text("\n".join(lines[1:]), encoding="utf-8")
    with_header = build_tokenizer("GPT2BPETokenizer", **gpt2_files)
    without = build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files["vocab_file"],
                              merge_file=str(headless))
    pair = "".join(first).replace("Ġ", " ")  # byte-level symbols of printable ASCII
    assert len(with_header.tokenize(pair)) == 1 and len(without.tokenize(pair)) == 2


@pytest.fixture(scope="module")
def sentencepiece_model(corpus):
    """A model of tools/train_tokenizer.py (the demo's kind), trained in this process."""
    prefix = corpus["dir"] / "sp"
    load_module("tools/train_tokenizer.py", "train_tokenizer").main(
        ["--input", str(corpus["jsonl"]), "--output-prefix", str(prefix), "--vocab-size", "500",
         "--num-threads", "1"])
    return str(prefix) + ".model"


def test_llama2_tokenizer_is_megatrons(sentencepiece_model, corpus, tmp_path):
    """Megatron-LM's _Llama2Tokenizer: tokenize(s, bos=True, eos=False) puts the model's bos in
    front of sentencepiece's ids; eod is eos; decode is sentencepiece's; no BERT symbols."""
    sp = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    tokenizer = build_tokenizer("Llama2Tokenizer", sentencepiece_model)
    assert (tokenizer.bos, tokenizer.eos, tokenizer.eod) == (sp.bos_id(), sp.eos_id(),
                                                             sp.eos_id())
    assert tokenizer.vocab_size == sp.vocab_size()
    assert (tokenizer.cls, tokenizer.sep, tokenizer.mask) == (-1, -1, -1)
    for text in TEXTS:
        assert tokenizer.tokenize(text) == [sp.bos_id()] + sp.encode(text), text
        assert tokenizer.tokenize(text, bos=False, eos=True) == sp.encode(text) + [sp.eos_id()]
        assert tokenizer.detokenize(sp.encode(text)) == sp.decode(sp.encode(text))
    # preprocessed, every document starts with bos and --append-eod ends it with eos
    preprocess(["--input", corpus["jsonl"], "--output-prefix", tmp_path / "llama",
                "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", sentencepiece_model,
                "--append-eod"])
    dataset = IndexedDataset(str(tmp_path / "llama_text_document"))
    for index, doc in enumerate(corpus["docs"][:5]):
        assert dataset[index].tolist() == [sp.bos_id()] + sp.encode(doc) + [sp.eos_id()]


def preprocess(argv):
    load_module("tools/preprocess_data.py", "preprocess_data").main([str(a) for a in argv])


def test_null_tokenizer_is_megatrons(tmp_path):
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=50)
    assert (tokenizer.vocab_size, tokenizer.eod) == (51, 50)
    assert tokenizer.tokenize("3 1 4 1 5") == [3, 1, 4, 1, 5]
    assert tokenizer.detokenize([2, 7, 1]) == "2 7 1"
    with pytest.raises(TokenizerError, match="token ids separated by single spaces"):
        tokenizer.tokenize("not ids")
    source = tmp_path / "ids.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("3 1 4", "1 5 9 2 6")))
    preprocess(["--input", source, "--output-prefix", tmp_path / "null", "--tokenizer-type",
                "NullTokenizer", "--vocab-size", "50", "--append-eod"])
    dataset = IndexedDataset(str(tmp_path / "null_text_document"))
    assert [dataset[i].tolist() for i in range(2)] == [[3, 1, 4, 50], [1, 5, 9, 2, 6, 50]]


def test_tokenizer_type_default_is_megatrons_recipes():
    gpt3_recipe = ["--vocab-file", "v.json", "--merge-file", "m.txt"]
    assert parse_args(gpt3_recipe).tokenizer_type == "GPT2BPETokenizer"
    assert parse_args(["--tokenizer-model", "t.model"]).tokenizer_type == \
        "SentencePieceTokenizer"
    assert parse_args(["--vocab-file", "v.json"]).tokenizer_type == "SentencePieceTokenizer"
    assert parse_args([*gpt3_recipe, "--tokenizer-type", "NullTokenizer"]).tokenizer_type == \
        "NullTokenizer"
    tool = load_module("tools/preprocess_data.py", "preprocess_data")
    assert tool.parse_args(["--input", "x", "--output-prefix", "y",
                            *gpt3_recipe]).tokenizer_type == "GPT2BPETokenizer"


def test_gpt2_bpe_preprocesses_trains_and_generates(corpus, gpt2_files, reference, tmp_path):
    """The GPT-3 recipe's flags (--vocab-file, --merge-file, no --tokenizer-type) through
    preprocessing, a 2-rank MoE run that saves, and generation from the checkpoint alone."""
    prefix = tmp_path / "gpt2"
    result = python("tools/preprocess_data.py", "--input", corpus["jsonl"], "--output-prefix",
                    prefix, "--vocab-file", gpt2_files["vocab_file"], "--merge-file",
                    gpt2_files["merge_file"], "--append-eod", "--workers", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    dataset = IndexedDataset(f"{prefix}_text_document")
    for index, doc in enumerate(corpus["docs"][:20]):
        assert dataset[index].tolist() == reference(doc)["input_ids"] + [reference.eos_token_id]

    ckpt = tmp_path / "ckpt"
    data = {"prefix": f"{prefix}_text_document", "tokenizer": None}
    run = launch(2, tiny_gpt_args(data, **gpt2_files_flags(gpt2_files), **{
        "expert-model-parallel-size": 2, "train-iters": 3, "save": ckpt}), tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.loss()) == 3, run.output[-3000:]
    saved = ckpt / "iter_0000003"
    assert json.loads((saved / "run.json").read_text())["args"]["tokenizer_type"] == \
        "GPT2BPETokenizer"
    for flag, copy in (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")):
        assert (saved / copy).read_bytes() == open(gpt2_files[flag], "rb").read()
    assert not (saved / "tokenizer.model").exists()
    # --use-checkpoint-args takes the type and the copies as well
    resumed = parse_args(["--load", str(ckpt), "--use-checkpoint-args"],
                         override=checkpoint_args.apply)
    assert (resumed.tokenizer_type, resumed.vocab_file, resumed.merge_file) == (
        "GPT2BPETokenizer", str(saved / "vocab.json"), str(saved / "merges.txt"))

    status, output = torchrun(["--nproc-per-node", 1, "--master-port", free_port(),
                               "tools/generate.py", "--load-dir", ckpt, "--prompt", PROMPT,
                               "--max-new-tokens", 8])
    assert status == 0, output[-3000:]
    lines = output.splitlines()
    prompt_ids = next(line for line in lines if line.startswith("prompt ids: ")).split()[2:]
    new_ids = [int(i) for i in next(line for line in lines if line.startswith("ids: "))
               .split()[1:]]
    assert [int(i) for i in prompt_ids] == reference(PROMPT)["input_ids"]
    assert 1 <= len(new_ids) <= 8 and all(0 <= i < len(reference) for i in new_ids)
    assert len(new_ids) == 8 or new_ids[-1] == reference.eos_token_id


def gpt2_files_flags(gpt2_files) -> dict:
    """tiny_gpt_args's overrides: the GPT-2 files instead of its --tokenizer-model."""
    return {"tokenizer-model": None, "vocab-file": gpt2_files["vocab_file"],
            "merge-file": gpt2_files["merge_file"]}


def test_generated_ids_past_the_tokenizer_are_shown(sentencepiece_model):
    """tools/generate.py's text line: a model with more embedding rows than its SentencePiece
    tokenizer has pieces can generate an id the tokenizer cannot detokenize (sentencepiece
    raises IndexError); it is written <id N>, the known ids around it as the tokenizer decodes
    them."""
    from parm_trainer.generation import readable

    tokenizer = build_tokenizer("SentencePieceTokenizer", sentencepiece_model)
    hello, world = tokenizer.tokenize("Hello"), tokenizer.tokenize(" world")
    size = tokenizer.vocab_size
    with pytest.raises(IndexError):
        tokenizer.detokenize(hello + [size])
    assert readable(tokenizer, hello + world) == tokenizer.detokenize(hello + world)
    assert readable(tokenizer, hello + [size, size + 7] + world) == (
        tokenizer.detokenize(hello) + f"<id {size}><id {size + 7}>" + tokenizer.detokenize(world))


def test_every_tokenizer_type_has_its_file_flags():
    """data/input_files.py checks each type's files before torch is imported, from its own
    table: a type added to data/tokenizer.py without a row there would be refused as unknown."""
    from parm_trainer.data.input_files import TOKENIZER_FILE_FLAGS
    from parm_trainer.data.tokenizer import TOKENIZERS

    assert set(TOKENIZERS) == set(TOKENIZER_FILE_FLAGS)
