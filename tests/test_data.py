"""python -m pytest tests/test_data.py -q

The data pipeline end to end on a tiny corpus: corpus tool, tokenizer
training, tokenizer wrapper, preprocessing into megatron.core indexed
datasets, and GPT dataset building, including the error paths.
"""

import importlib.util
import inspect
import json
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import sentencepiece

from conftest import python

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron.core: optional GPU extensions missing
    from megatron.core.datasets.indexed_dataset import IndexedDataset

from parm_trainer.data.gpt_datasets import build_gpt_datasets
from parm_trainer.data.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
VOCAB_SIZE = 400
CORPUS_MODULES = ["argparse", "collections", "csv", "datetime", "functools", "heapq",
                  "itertools", "json", "logging", "pathlib", "shutil", "string",
                  "tempfile", "textwrap"]
EXTRA_DOCS = [
    "Naïve café — “quotes”, ✓ and 日本語 survive the round trip. Dr. Smith said so!\n\n"
    "    Indented code: x = {'a': 1}\n\tTabs too. Is it over? Yes. 42 is the answer."
]


def run_tool(name, *args):
    """Run tools/NAME.py as a command line; fail the test with its stderr."""
    proc = python(TOOLS / f"{name}.py", *args)
    assert proc.returncode == 0, proc.stderr
    return proc


def load_tool(name):
    """Import tools/NAME.py in-process (quicker than a subprocess)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stdlib_documents():
    """A few hundred real documents: docstrings of some stdlib modules."""
    docs = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if getattr(obj, "__module__", None) == name else None
            if doc and len(doc) >= 200 and doc not in docs:
                docs.append(doc)
    return docs + EXTRA_DOCS


def write_jsonl(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def docs():
    return stdlib_documents()


@pytest.fixture(scope="module")
def corpus(work, docs):
    path = write_jsonl(work / "corpus.jsonl", docs)
    with open(path, "a") as f:
        f.write("\n")  # a blank line is skipped, not an error
    return path


@pytest.fixture(scope="module")
def model_file(work, corpus):
    run_tool("train_tokenizer", "--input", corpus, "--json-keys", "text",
             "--output-prefix", work / "tok", "--vocab-size", VOCAB_SIZE)
    return str(work / "tok.model")


@pytest.fixture(scope="module")
def tokenizer(model_file):
    return build_tokenizer("SentencePieceTokenizer", model_file)


@pytest.fixture(scope="module")
def preprocess():
    return load_tool("preprocess_data")


def preprocess_args(corpus, model_file, prefix, *extra):
    return ["--input", str(corpus), "--json-keys", "text", "--output-prefix", str(prefix),
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model_file,
            "--append-eod", *map(str, extra)]


@pytest.fixture(scope="module")
def document_prefix(work, corpus, model_file, preprocess):
    """Preprocessed once with 1 worker in-process, once with 2 by command line."""
    preprocess.main(preprocess_args(corpus, model_file, work / "w1", "--workers", 1))
    run_tool("preprocess_data", *preprocess_args(corpus, model_file, work / "w2",
                                                 "--workers", 2, "--log-interval", 50))
    return work / "w1_text_document"


# --------------------------------------------------------------- corpus tool

def test_make_demo_corpus(work):
    out = work / "demo.jsonl"
    proc = run_tool("make_demo_corpus", "--output", out, "--max-bytes", 200_000)
    assert "documents" in proc.stdout
    texts = [json.loads(line)["text"] for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(texts) >= 10
    assert out.stat().st_size <= 200_000
    assert len(set(texts)) == len(texts)
    assert min(map(len, texts)) >= 200


# ----------------------------------------------------------------- tokenizer

def test_special_tokens(tokenizer):
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert (tokenizer.pad, tokenizer.bos, tokenizer.eos) == (0, 2, 3)
    assert tokenizer.eod == tokenizer.eos
    assert tokenizer.has_bert_special_tokens
    specials = [tokenizer.pad, tokenizer.bos, tokenizer.eos,
                tokenizer.cls, tokenizer.sep, tokenizer.mask]
    assert len(set(specials)) == len(specials)
    assert [tokenizer.inv_vocab[i] for i in specials[3:]] == ["[CLS]", "[SEP]", "[MASK]"]
    assert all(tokenizer.vocab[tokenizer.inv_vocab[i]] == i for i in range(VOCAB_SIZE))


def test_round_trip(tokenizer, docs):
    for doc in docs:
        ids = tokenizer.tokenize(doc)
        assert all(isinstance(i, int) and 0 <= i < VOCAB_SIZE for i in ids)
        assert tokenizer.detokenize(ids) == doc
    # Special ids never come out of ordinary text.
    all_ids = {i for doc in docs for i in tokenizer.tokenize(doc)}
    assert not all_ids & {tokenizer.pad, tokenizer.eod, tokenizer.cls, tokenizer.mask}


def test_tokenizer_pickles(tokenizer):
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert copy.tokenize(EXTRA_DOCS[0]) == tokenizer.tokenize(EXTRA_DOCS[0])


def test_train_tokenizer_is_deterministic(work, corpus, model_file):
    run_tool("train_tokenizer", "--input", corpus, "--output-prefix", work / "tok_again",
             "--vocab-size", VOCAB_SIZE, "--input-sentence-size", 300, "--num-threads", 1)
    run_tool("train_tokenizer", "--input", corpus, "--output-prefix", work / "tok_again2",
             "--vocab-size", VOCAB_SIZE, "--input-sentence-size", 300, "--num-threads", 2)
    assert (work / "tok_again.vocab").read_bytes() == (work / "tok_again2.vocab").read_bytes()


def test_tokenizer_without_bert_symbols(work, corpus, docs):
    prefix = work / "plain"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(docs), model_prefix=str(prefix), vocab_size=200,
        pad_id=0, unk_id=1, bos_id=2, eos_id=3, minloglevel=2)
    plain = build_tokenizer("SentencePieceTokenizer", f"{prefix}.model")
    assert not plain.has_bert_special_tokens
    with pytest.raises(ValueError, match="without BERT special tokens.*train_tokenizer.py"):
        plain.mask


def test_build_tokenizer_errors(work, model_file):
    with pytest.raises(ValueError, match="--tokenizer-type"):
        build_tokenizer("GPT2BPETokenizer", model_file)
    with pytest.raises(ValueError, match="--tokenizer-model .*: no such file"):
        build_tokenizer("SentencePieceTokenizer", str(work / "missing.model"))


# ------------------------------------------------------------- preprocessing

def test_workers_give_identical_output(work, document_prefix):
    for suffix in (".bin", ".idx"):
        one = (work / f"w1_text_document{suffix}").read_bytes()
        two = (work / f"w2_text_document{suffix}").read_bytes()
        assert one == two, suffix


def test_indexed_dataset_holds_the_tokens(document_prefix, model_file, docs):
    # Independent of the wrapper: encode with sentencepiece directly.
    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    dataset = IndexedDataset(str(document_prefix))
    assert len(dataset) == len(docs)
    for i, doc in enumerate(docs):
        assert dataset[i].tolist() == sp.encode(doc) + [sp.eos_id()]


def test_split_sentences(work, corpus, model_file, preprocess, docs):
    preprocess.main(preprocess_args(corpus, model_file, work / "s", "--split-sentences"))
    dataset = IndexedDataset(str(work / "s_text_sentence"))
    boundaries = dataset.document_indices
    assert len(boundaries) == len(docs) + 1
    assert len(dataset) > len(docs)
    eod = sentencepiece.SentencePieceProcessor(model_file=model_file).eos_id()
    for end in boundaries[1:]:
        assert dataset[int(end) - 1][-1] == eod  # eod closes each document


def test_sentence_splitter(preprocess):
    text = 'One sentence. "Two?" Three e.g. four!\n\nfive (lower case) ends. 6 starts.'
    sentences = preprocess.split_sentences(text)
    assert sentences == ["One sentence.", ' "Two?"', " Three e.g. four!",
                         "\n\nfive (lower case) ends.", " 6 starts."]
    assert "".join(sentences) == text  # lossless: sentences tokenize as inside the document


@pytest.mark.parametrize("line, message", [
    ('{"text": "fine"}\n{"text": broken\n', r"bad\.jsonl:2: invalid JSON"),
    ('{"body": "no text key"}\n', r"bad\.jsonl:1: missing JSON key 'text'"),
    ('{"text": 7}\n', r"bad\.jsonl:1: JSON key 'text' is int"),
])
def test_preprocess_input_errors(work, model_file, preprocess, line, message):
    bad = work / "bad.jsonl"
    bad.write_text(line)
    with pytest.raises(SystemExit, match=message):
        preprocess.main(preprocess_args(bad, model_file, work / "bad"))
    assert not list(work.glob("bad_text_document*"))  # nothing half-written left


def test_preprocess_missing_input(work, model_file, preprocess):
    with pytest.raises(SystemExit, match="--input .*nothing.jsonl not found"):
        preprocess.main(preprocess_args(work / "nothing.jsonl", model_file, work / "x"))


# -------------------------------------------------------------- GPT datasets

def test_gpt_datasets(work, document_prefix, tokenizer):
    seq_length = 32
    train, valid, test = build_gpt_datasets(
        [str(document_prefix)], "90,5,5", seq_length, 1234, tokenizer,
        (200, 20, 20), data_cache_path=str(work / "cache"))
    assert len(train) >= 200 and len(valid) >= 20 and len(test) >= 20
    for dataset in (train, valid, test):
        sample = dataset[0]
        tokens, labels = sample["tokens"], sample["labels"]
        assert tokens.shape == labels.shape == (seq_length,)
        assert tokens[1:].tolist() == labels[:-1].tolist()
        assert sample["loss_mask"].shape == (seq_length,)
    # Same seed, same samples (indices are rebuilt or loaded from the cache).
    again, _, _ = build_gpt_datasets(
        [str(document_prefix)], "90,5,5", seq_length, 1234, tokenizer,
        (200, 20, 20), data_cache_path=str(work / "cache"))
    assert again[7]["tokens"].tolist() == train[7]["tokens"].tolist()


def test_weighted_blend_without_torch_distributed(work, document_prefix, tokenizer):
    other = work / "w2_text_document"
    train, valid, _ = build_gpt_datasets(
        [f"0.3 {document_prefix} 0.7 {other}"], "90,5,5", 16, 1, tokenizer,
        (100, 10, 10), data_cache_path=str(work / "cache_blend"))
    assert len(train) == 100 and len(valid) == 10
    assert train[0]["tokens"].shape == (16,)


def test_missing_prefix(work, tokenizer):
    with pytest.raises(FileNotFoundError, match=r"nowhere_text_document\.bin not found"):
        build_gpt_datasets([str(work / "nowhere_text_document")], "90,5,5", 16, 1,
                           tokenizer, (10, 1, 1))


@pytest.mark.parametrize("damage, message", [
    (lambda idx: b"not an index at all" * 4, "bad header magic"),
    (lambda idx: idx[: len(idx) // 2], "truncated"),
])
def test_corrupt_idx(work, document_prefix, tokenizer, damage, message):
    prefix = work / "corrupt_text_document"
    shutil.copy(f"{document_prefix}.bin", f"{prefix}.bin")
    idx = Path(f"{document_prefix}.idx").read_bytes()
    Path(f"{prefix}.idx").write_bytes(damage(idx))
    with pytest.raises(ValueError, match=rf"corrupt_text_document\.idx .*{message}"):
        build_gpt_datasets([str(prefix)], "90,5,5", 16, 1, tokenizer, (10, 1, 1))


def test_split_with_no_documents(work, model_file, preprocess, docs, tokenizer):
    # megatron.core would loop forever building a split that got no documents.
    tiny = write_jsonl(work / "tiny.jsonl", docs[:3])
    preprocess.main(preprocess_args(tiny, model_file, work / "tiny"))
    with pytest.raises(ValueError, match="too few"):
        build_gpt_datasets([str(work / "tiny_text_document")], "90,5,5", 16, 1,
                           tokenizer, (10, 1, 1))
