"""python tools/preprocess_data.py --input data/demo/corpus.jsonl --json-keys text --output-prefix data/demo/corpus --tokenizer-type SentencePieceTokenizer --tokenizer-model data/demo/tokenizer.model --append-eod --workers 2

Tokenize a jsonl corpus into megatron.core indexed datasets, one per JSON key:
``{PREFIX}_{key}_document.bin/.idx`` (``_sentence`` with --split-sentences).
Pass ``{PREFIX}_{key}_document`` to the trainer's --data-path.

The tokenizer flags are pretrain's (Megatron-LM's): --tokenizer-type SentencePieceTokenizer or
Llama2Tokenizer with --tokenizer-model, GPT2BPETokenizer with --vocab-file and --merge-file
(the default when both are given), NullTokenizer with --vocab-size.

Every document becomes one sequence (with --append-eod, followed by the
tokenizer's eod id). With --split-sentences every sentence is its own
sequence and the document boundary is kept in the index (eod, if asked for,
ends the last sentence); that is the layout BERT-style datasets expect
(pretrain_bert_moe.py takes ``{PREFIX}_{key}_sentence``).

The sentence splitter is deliberately simple and needs no download: a
sentence ends at '.', '!' or '?' (optionally followed by closing quotes or
brackets) when whitespace and then an upper-case letter, digit, quote or
bracket follow; a blank line always ends one. Each sentence keeps the
whitespace before it, so a document's sentences joined give back its text
and tokenize as they do inside it. Abbreviations ("e.g. Python") are split
wrongly; that is acceptable for building BERT's sentence pairs.

Lines are tokenized by --workers processes, but documents are written in
input order, so the output is byte-identical for any worker count. Files are
written under temporary names and renamed at the end, so a failed run never
leaves a dataset that looks complete.
"""

import argparse
import multiprocessing
import os
import re
import sys
import time
import warnings

with warnings.catch_warnings():
    # megatron.core warns at import time about optional GPU extensions.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from parm_trainer.process_exit import end
from parm_trainer.data.jsonl import make_output_dir, parse_record  # noqa: E402 (after the filter)
from parm_trainer.arguments.flags import add_tokenizer_flags, default_tokenizer_type  # noqa
from parm_trainer.data.tokenizer import tokenizer_from_args  # noqa: E402

# The sentence splitter described in the docstring above.
SENTENCE_END = re.compile(r"""(?<=[.!?])["')\]]*\s+(?=["'(\[]?[A-Z0-9])|\n\s*\n""")


def split_sentences(text):
    """Split text into sentences, each with the whitespace before it; pieces holding only
    whitespace are dropped, so "".join(split_sentences(text)) is text up to such pieces."""
    pieces = []
    start = 0
    for match in SENTENCE_END.finditer(text):
        end = match.start() + len(match.group(0).rstrip())  # closing quotes stay with it
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return [p for p in pieces if p.strip()]


class Encoder:
    """Turns one jsonl line into token ids; one instance per worker process."""

    def __init__(self, args):
        self.args = args
        self.tokenizer = tokenizer_from_args(args)

    def encode(self, numbered_line):
        """(line number, line) -> ({key: [ids of each sentence]} or None, size).

        None stands for a blank line; size is the line's length in bytes.
        """
        lineno, line = numbered_line
        size = len(line.encode("utf-8"))
        if not line.strip():
            return None, size
        record = parse_record(self.args.input, lineno, line, self.args.json_keys)
        encoded = {}
        for key in self.args.json_keys:
            text = record[key]
            parts = split_sentences(text) if self.args.split_sentences else [text]
            sentences = [ids for ids in map(self.tokenizer.tokenize, parts) if ids]
            if sentences and self.args.append_eod:
                sentences[-1] = sentences[-1] + [self.tokenizer.eod]
            encoded[key] = sentences
        return encoded, size


# Module-level so that worker processes can reach it.
_ENCODER = None


def _init_worker(args):
    global _ENCODER
    _ENCODER = Encoder(args)


def _encode(numbered_line):
    return _ENCODER.encode(numbered_line)


def iter_encoded(args, lines):
    """Encoded documents in input order, using args.workers processes."""
    if args.workers == 1:
        _init_worker(args)
        yield from map(_encode, lines)
        return
    with multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args,)) as pool:
        yield from pool.imap(_encode, lines, chunksize=args.chunksize)


def output_prefix(args, key):
    level = "sentence" if args.split_sentences else "document"
    return f"{args.output_prefix}_{key}_{level}"


class Writers:
    """One IndexedDatasetBuilder per JSON key, written under temporary names."""

    def __init__(self, args, vocab_size):
        self.paths = {key: output_prefix(args, key) for key in args.json_keys}
        # uint16 ids when the vocabulary fits, else int32.
        dtype = DType.optimal_dtype(vocab_size)
        self.builders = {key: IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=dtype)
                         for key, prefix in self.paths.items()}
        self.documents = dict.fromkeys(self.paths, 0)
        self.tokens = dict.fromkeys(self.paths, 0)

    def add(self, encoded):
        for key, sentences in encoded.items():
            if not sentences:
                continue  # an empty document would only be an empty sample
            ids = [i for sentence in sentences for i in sentence]
            # One sequence per sentence, then the document boundary.
            self.builders[key].add_document(ids, [len(s) for s in sentences])
            self.documents[key] += 1
            self.tokens[key] += len(ids)

    def finalize(self):
        for key, prefix in self.paths.items():
            self.builders[key].finalize(prefix + ".idx.tmp")
            os.replace(prefix + ".bin.tmp", prefix + ".bin")
            os.replace(prefix + ".idx.tmp", prefix + ".idx")

    def discard(self):
        for builder in self.builders.values():
            builder.data_file.close()
        for prefix in self.paths.values():
            for suffix in (".bin.tmp", ".idx.tmp"):
                if os.path.exists(prefix + suffix):
                    os.remove(prefix + suffix)


def preprocess(args):
    tokenizer = tokenizer_from_args(args)  # checks the flags before any file is written
    make_output_dir(args.output_prefix)
    writers = Writers(args, tokenizer.vocab_size)
    start = time.time()
    done = total_bytes = 0
    try:
        with open(args.input, encoding="utf-8") as f:
            for encoded, nbytes in iter_encoded(args, enumerate(f, start=1)):
                total_bytes += nbytes
                if encoded is None:
                    continue
                writers.add(encoded)
                done += 1
                if done % args.log_interval == 0:
                    elapsed = time.time() - start
                    print(f"processed {done} documents ({done / elapsed:.0f} docs/s, "
                          f"{total_bytes / elapsed / 1e6:.2f} MB/s)", file=sys.stderr)
        if not any(writers.documents.values()):
            raise ValueError(f"--input {args.input} holds no documents (every line is blank or "
                             f"its --json-keys text is empty)")
        writers.finalize()
    except BaseException:
        writers.discard()
        raise
    elapsed = time.time() - start
    for key, prefix in writers.paths.items():
        print(f"{prefix}.bin/.idx: {writers.documents[key]} documents, "
              f"{writers.tokens[key]} tokens")
    print(f"{done} lines, {total_bytes / 1e6:.2f} MB in {elapsed:.1f}s "
          f"with {args.workers} worker(s)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="input .jsonl file")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract; one dataset per key (default: text)")
    group.add_argument("--split-sentences", action="store_true",
                       help="one sequence per sentence, document boundaries kept (for BERT); "
                            "a sentence ends at . ! or ? before whitespace and an upper-case "
                            "letter, digit, quote or bracket, or at a blank line; writes "
                            "PREFIX_{key}_sentence")
    group = parser.add_argument_group("tokenizer")
    add_tokenizer_flags(group)  # pretrain's, Megatron-LM's
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to every document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="writes PREFIX_{key}_document.bin/.idx (_sentence with "
                            "--split-sentences)")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--chunksize", type=int, default=32,
                       help="lines handed to a worker at a time")
    group.add_argument("--log-interval", type=int, default=10000,
                       help="report progress every this many documents")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.chunksize < 1 or args.log_interval < 1:
        parser.error("--workers, --chunksize and --log-interval must be >= 1")
    if args.vocab_size is not None and args.vocab_size < 1:
        parser.error(f"--vocab-size must be at least 1, got {args.vocab_size}")
    args.tokenizer_type = args.tokenizer_type or default_tokenizer_type(args)
    return args


def main(argv=None):
    args = parse_args(argv)
    if not os.path.isfile(args.input):
        sys.exit(f"error: --input {args.input} not found")
    try:
        preprocess(args)
    except UnicodeDecodeError as err:
        sys.exit(f"error: --input {args.input} is not UTF-8 text ({err.reason})")
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    end(main())
