"""python tools/train_tokenizer.py --input data/demo/corpus.jsonl --json-keys text --output-prefix data/demo/tokenizer --vocab-size 8000 --model-type bpe

Train a SentencePiece tokenizer on a jsonl corpus; writes PREFIX.model and
PREFIX.vocab, to be passed to the trainer and to tools/preprocess_data.py as
``--tokenizer-type SentencePieceTokenizer --tokenizer-model PREFIX.model``.

The same model serves GPT and BERT, so ids 0-6 are always reserved:

    0 <pad>   1 <unk>   2 <s> (bos)   3 </s> (eos, used as end-of-document)
    4 [CLS]   5 [SEP]   6 [MASK]

Text is kept verbatim (identity normalization, whitespace preserved) and with
byte fallback on, any string survives tokenize/detokenize unchanged. Training
sees one line at a time, so no piece spans a newline: a newline is always the
single byte piece <0x0A> (<unk> with --no-byte-fallback). Training is
deterministic: the line sample is drawn with --seed, and the result does not
depend on --num-threads.
"""

import argparse
import os
import random
import sys
import time

import sentencepiece as spm

from parm_trainer.data.jsonl import iter_jsonl_texts, make_output_dir
from parm_trainer.data.tokenizer import BERT_SYMBOLS

SPECIAL_IDS = {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}


def iter_training_lines(path, keys):
    """Every non-blank line of every document, without its newline."""
    for text in iter_jsonl_texts(path, keys):
        for line in text.splitlines():
            if line.strip():
                yield line


def sample_lines(lines, size, seed):
    """A uniform, reproducible sample of `size` lines (all lines if size is 0).

    Done here rather than by SentencePiece: its own sampler gave a different
    vocabulary on every run (sentencepiece 0.2, even after
    set_random_generator_seed).
    """
    if size <= 0:
        # SentencePiece keeps every line in memory anyway; reading them here
        # first lets input errors surface as themselves, not wrapped by it.
        return list(lines)
    rng = random.Random(seed)
    reservoir = []
    for i, line in enumerate(lines):
        if i < size:
            reservoir.append(line)
        else:
            j = rng.randrange(i + 1)
            if j < size:
                reservoir[j] = line
    return reservoir


def train(args):
    """Run the SentencePiece trainer; it writes PREFIX.model and PREFIX.vocab."""
    make_output_dir(args.output_prefix)
    lines = sample_lines(iter_training_lines(args.input, args.json_keys),
                         args.input_sentence_size, args.seed)
    if not lines:  # sentencepiece would say only "[!sentences_.empty()]"
        raise ValueError(f"--input {args.input} has no text to train on (no non-blank line "
                         f"under --json-keys {' '.join(args.json_keys)})")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=args.output_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        user_defined_symbols=list(BERT_SYMBOLS),  # ids 4, 5, 6
        **SPECIAL_IDS,
        byte_fallback=args.byte_fallback,
        character_coverage=args.character_coverage,
        # Keep text verbatim so detokenize(tokenize(text)) == text.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        # No "▁" glued to the first word: documents are tokenized whole, so
        # only their first line would get one, while training sees lines.
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        input_sentence_size=0,  # sampled above
        shuffle_input_sentence=False,
        max_sentence_length=args.max_sentence_length,
        num_threads=args.num_threads,
        minloglevel=1,  # warnings and errors only
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="input .jsonl file")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys of the text fields to train on (default: text)")
    parser.add_argument("--output-prefix", required=True,
                        help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--input-sentence-size", type=int, default=1_000_000,
                        help="train on a seeded random sample of at most this many "
                             "lines (0: all)")
    parser.add_argument("--max-sentence-length", type=int, default=16384,
                        help="lines longer than this many bytes are left out of training")
    parser.add_argument("--character-coverage", type=float, default=0.9999,
                        help="share of characters that get their own piece; the rest "
                             "fall back to bytes")
    parser.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction,
                        default=True, help="encode unknown characters as UTF-8 bytes "
                                           "instead of <unk> (default: on)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--num-threads", type=int, default=min(8, os.cpu_count() or 1))
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not os.path.isfile(args.input):
        sys.exit(f"error: --input {args.input} not found")
    start = time.time()
    try:
        train(args)
    except UnicodeDecodeError as err:
        sys.exit(f"error: --input {args.input} is not UTF-8 text ({err.reason})")
    except ValueError as err:
        sys.exit(f"error: {err}")
    except RuntimeError as err:
        # SentencePiece's own checks, e.g. a vocabulary larger than the corpus
        # supports: "INTERNAL: src/trainer_interface.cc(...) [condition] Vocabulary
        # size is too high ..."; the words after the condition say it.
        said = str(err).split("] ", 1)[-1]
        sys.exit(f"error: sentencepiece cannot train --vocab-size {args.vocab_size} on "
                 f"--input {args.input}: {said}")
    sp = spm.SentencePieceProcessor(model_file=args.output_prefix + ".model")
    print(f"wrote {args.output_prefix}.model and .vocab: {args.model_type}, "
          f"vocab size {sp.vocab_size()}, pad/unk/bos/eos = {sp.pad_id()}/{sp.unk_id()}/"
          f"{sp.bos_id()}/{sp.eos_id()}, {', '.join(BERT_SYMBOLS)} = "
          f"{', '.join(str(sp.piece_to_id(s)) for s in BERT_SYMBOLS)}, "
          f"in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
