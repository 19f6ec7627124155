"""Continued pretraining of a published Hugging Face MoE, the whole workflow a user runs:

    convert.py --loader hf --saver parm      a Qwen3-MoE (QK norms, GQA) with its tokenizer.json
    preprocess_data.py                      the corpus, with the tokenizer the import carries
    pretrain_gpt_moe.py                     20 iterations on 4 ranks (TP 2 x EP 2), Parm's
                                            defaults, from the import's printed command line
    convert.py --loader parm --saver hf      the trained checkpoint back to transformers
    transformers                            loads it with no missing or unexpected keys, and
                                            its greedy continuation is tools/generate.py's

The model was made by transformers itself (random, seeded); the tokenizer is a byte-level BPE
built with the `tokenizers` library (data_fixtures.py hf_dir).
"""

import json
import shlex
import warnings

import numpy
import torch

from conftest import free_port, launch, python, torchrun
from test_convert_stream import TOKENIZER_FILES, convert
from test_tokenizers import PROMPT

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers import (AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

ITERATIONS = 20


def rows_of(tokens: int) -> int:
    return -(-tokens // 128) * 128 + 8


def _qwen3_moe(directory, tokenizer_dir):
    """A Qwen3-MoE whose embedding has more rows than its tokenizer padded to 128, as the
    published ones do (151,936 rows, 151,665 tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3MoeConfig(vocab_size=rows_of(len(tokenizer)), hidden_size=64,
                            intermediate_size=96,
                            moe_intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[],
                            max_position_embeddings=128, rope_theta=10000.0,
                            tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            (directory / name).write_bytes((tokenizer_dir / name).read_bytes())
    return tokenizer


def _printed_flags(stdout: str) -> list:
    """The model and load flags of the command line the import prints."""
    line = next(l for l in stdout.splitlines() if l.strip().startswith("pretrain_gpt_moe.py"))
    words = shlex.split(line)
    return words[1:words.index("--data-path")]


def test_import_preprocess_train_export_generate(gpt_data, hf_dir, tmp_path):
    original, imported = tmp_path / "qwen3", tmp_path / "imported"
    trained, exported = tmp_path / "trained", tmp_path / "exported"
    tokenizer = _qwen3_moe(original, hf_dir)

    result = convert("--loader", "hf", "--saver", "parm", "--load-dir", original,
                     "--save-dir", imported)
    assert result.returncode == 0, result.stderr[-3000:]
    flags = _printed_flags(result.stdout)
    assert "--qk-layernorm" in flags and "HuggingFaceTokenizer" in flags, flags
    rows = rows_of(len(tokenizer))  # training pads the vocabulary to the checkpoint's rows
    assert flags[flags.index("--make-vocab-size-divisible-by") + 1] == str(rows), flags
    copy = imported / "iter_0000000" / "hf_tokenizer"

    prefix = tmp_path / "corpus"
    result = python("tools/preprocess_data.py", "--input", gpt_data["dir"] / "corpus.jsonl",
                    "--json-keys", "text", "--output-prefix", prefix, "--append-eod",
                    "--workers", "1", "--tokenizer-type", "HuggingFaceTokenizer",
                    "--tokenizer-model", copy)
    assert result.returncode == 0, result.stderr[-3000:]
    first = json.loads(open(gpt_data["dir"] / "corpus.jsonl").readline())["text"]
    expected = tokenizer(first).input_ids + [tokenizer.eos_token_id]
    tokens = numpy.fromfile(f"{prefix}_text_document.bin", dtype=numpy.uint16)
    assert tokens[:len(expected)].tolist() == expected

    run = launch(4, [*flags, "--data-path", f"{prefix}_text_document",
                     "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                     "--seq-length", "64", "--micro-batch-size", "2",
                     "--global-batch-size", "8", "--lr", "3e-3", "--train-iters",
                     str(ITERATIONS), "--lr-warmup-iters", "2", "--log-interval", "1",
                     "--eval-interval", "1000", "--eval-iters", "1", "--split", "90,5,5",
                     "--save", trained, "--save-interval", str(ITERATIONS)], tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    losses = run.loss()
    assert len(losses) == ITERATIONS and losses[-1] < losses[0], losses
    assert f"resumed from {imported} at iteration 0" in run.output, run.output[-3000:]

    result = convert("--loader", "parm", "--saver", "hf", "--load-dir", trained,
                     "--save-dir", exported)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Qwen3MoeForCausalLM" in result.stdout, result.stdout
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info

    prompt_ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt_ids]), max_new_tokens=20,
                                do_sample=False,
                                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    status, output = torchrun(["--nproc-per-node", 1, "--master-port", free_port(),
                               "tools/generate.py", "--load-dir", trained, "--prompt", PROMPT,
                               "--max-new-tokens", 20])
    assert status == 0, output[-3000:]
    ours = next(l for l in output.splitlines() if l.startswith("ids: "))
    assert [int(i) for i in ours.split()[1:]] == theirs[0, len(prompt_ids):].tolist()
