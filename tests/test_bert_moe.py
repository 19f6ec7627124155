"""MoE BERT (pretrain_bert_moe.py): every layout and schedule trains the single-rank model,
resume is exact, and bad input is refused.

The data is the GPT tests' corpus and tokenizer, preprocessed with --split-sentences, and the
model the GPT tests' tiny one (tiny_gpt_args) with BERT's heads. Each launch checks a whole
layout at once: masked-LM loss, sentence-order loss and accuracy, the
router's load-balancing loss and the tokens each expert received.
"""

import json
import warnings

import numpy
import pytest
import sentencepiece
import torch

from conftest import assert_clean_failure, launch, max_relative, python, run_tool, tiny_gpt_args

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron.core: optional GPU extensions missing
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from safetensors.torch import load_file

    from parm_trainer.data.bert_datasets import DataError, build_bert_datasets
    from parm_trainer.data.tokenizer import build_tokenizer

BERT = "pretrain_bert_moe.py"
TP2_EP2_ESP2 = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
                "expert-tensor-parallel-size": 2}
LAYOUTS = {
    "tp2_ep2_esp2_s1": (4, {**TP2_EP2_ESP2, "sequence-parallel": True,
                            "moe-parm-schedule": "s1"}),
    "tp2_ep2_esp2_s2": (4, {**TP2_EP2_ESP2, "sequence-parallel": True,
                            "moe-parm-schedule": "s2"}),
    # without sequence parallelism: the pooler and heads see replicated hidden states
    "tp2_ep2_esp2_baseline": (4, {**TP2_EP2_ESP2, "moe-parm-schedule": "baseline"}),
    # the heads on the last stage, the padding mask on both, tied embeddings across stages
    "pp2": (2, {"pipeline-model-parallel-size": 2}),
}
SOP = ("sop loss", "sop accuracy")


@pytest.fixture(scope="module")
def reference(bert_data, tmp_path_factory):
    run = launch(1, tiny_gpt_args(bert_data), tmp_path_factory.mktemp("ref"), script=BERT)
    assert run.returncode == 0, run.output[-4000:]
    return run


def test_reference_learns_and_reports(reference):
    """Guards the comparisons below against a model that does nothing, and checks the logs."""
    losses = reference.loss()
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.01, losses
    for name in (*SOP, "load_balancing_loss"):
        assert all(numpy.isfinite(reference.loss(name))), name
    # dropless top-2: each MoE layer assigns every token of the global batch (8 x 64) twice
    for table in reference.loss("tokens per expert"):
        assert [sum(row) for row in table] == [8 * 64 * 2] * 2, table
    out = reference.output
    assert "tokens per expert at iteration 5 | layer 1: " in out
    # sentence-order loss and accuracy at every evaluation (here: start and end)
    evaluations = [line for line in out.splitlines() if line.startswith("validation (")]
    assert len(evaluations) == 2 and all("sop loss" in line and "sop accuracy" in line
                                         for line in evaluations), evaluations


@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_five_losses_match_single_rank(layout, reference, bert_data, tmp_path):
    nproc, flags = LAYOUTS[layout]
    run = launch(nproc, tiny_gpt_args(bert_data, **flags), tmp_path, script=BERT)
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.loss()) == 5
    for name in ("lm loss", "sop loss", "load_balancing_loss"):
        assert max_relative(run.loss(name), reference.loss(name)) < 1e-4, \
            (name, run.loss(name), reference.loss(name))
    assert run.loss("sop accuracy") == reference.loss("sop accuracy")
    assert run.loss("tokens per expert") == reference.loss("tokens per expert")


def test_masked_lm_only(bert_data, tmp_path):
    """--bert-no-binary-head: no sentence-order head, no token types, masked LM still learns."""
    args = tiny_gpt_args(bert_data, **{"bert-no-binary-head": True, "num-layers": 1})
    run = launch(1, args, tmp_path, script=BERT)
    assert run.returncode == 0, run.output[-4000:]
    losses = run.loss()
    assert losses[-1] < losses[0] - 0.01, losses
    assert not any(name in run.losses[0] for name in SOP), run.losses[0]


def test_resume_is_exact(bert_data, tmp_path):
    """Iterations 5-8 after a resume from iteration 4 equal those of the straight run, on 4
    ranks, with dropout (RNG streams restored) and the distributed optimizer."""
    layout = {**TP2_EP2_ESP2, "sequence-parallel": True, "use-distributed-optimizer": True,
              "hidden-dropout": 0.1, "attention-dropout": 0.1, "lr-warmup-iters": 3,
              "train-iters": 8}
    ckpt = tmp_path / "ckpt"
    straight = launch(4, tiny_gpt_args(bert_data, **layout, **{"save": ckpt,
                                                               "save-interval": 4}),
                      tmp_path, script=BERT)
    assert straight.returncode == 0, straight.output[-4000:]
    assert (ckpt / "iter_0000004" / "metadata.json").exists()
    # as if the run had stopped right after saving iteration 4
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")

    resumed = launch(4, tiny_gpt_args(bert_data, **layout, **{"load": ckpt}), tmp_path,
                     script=BERT)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "resumed from" in resumed.output
    assert [r["iteration"] for r in resumed.losses] == list(range(5, 9))
    for name in ("lm loss", *SOP, "load_balancing_loss"):
        for step, (a, b) in enumerate(zip(straight.loss(name)[4:], resumed.loss(name)), 5):
            assert abs(a - b) <= 1e-6, f"{name} at iteration {step}: straight {a}, resumed {b}"


def test_resume_under_another_layout(bert_data, tmp_path):
    """Saved at iteration 4 under TP2 x EP2 x ESP2 + SP, resumed under PP2 x EP2: iterations
    5-8 give the losses of the run that went on (dropout off)."""
    saved = {**TP2_EP2_ESP2, "sequence-parallel": True, "use-distributed-optimizer": True,
             "lr-warmup-iters": 3, "train-iters": 8}
    ckpt = tmp_path / "ckpt"
    straight = launch(4, tiny_gpt_args(bert_data, **saved, **{"save": ckpt, "save-interval": 4}),
                      tmp_path, script=BERT)
    assert straight.returncode == 0, straight.output[-4000:]
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    other = {"pipeline-model-parallel-size": 2, "expert-model-parallel-size": 2,
             "use-distributed-optimizer": True, "lr-warmup-iters": 3, "train-iters": 8}
    resumed = launch(4, tiny_gpt_args(bert_data, **other, load=ckpt), tmp_path, script=BERT)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "RNG streams not restored" in resumed.output
    assert [r["iteration"] for r in resumed.losses] == list(range(5, 9))
    for name in ("lm loss", "sop loss", "load_balancing_loss"):
        assert max_relative(resumed.loss(name), straight.loss(name)[4:]) <= 1e-4, name

    # no Hugging Face class holds an MoE BERT: it exports as documented safetensors + config,
    # which import back bit for bit and train (weights only, iteration 0)
    exported, imported, again = (tmp_path / name for name in ("bert_hf", "imported", "again"))
    reports = [run_tool("tools/checkpoint/convert.py", "--loader", loader, "--saver", saver,
                        "--load-dir", source, "--save-dir", target).stdout
               for loader, saver, source, target in (("parm", "hf", ckpt, exported),
                                                     ("hf", "parm", exported, imported),
                                                     ("parm", "hf", imported, again))]
    assert json.loads((exported / "config.json").read_text())["model_type"] == \
        "parm_trainer_bert_moe"
    first, second = (load_file(d / "model.safetensors") for d in (exported, again))
    assert sorted(first) == sorted(second) and all(torch.equal(first[k], second[k])
                                                   for k in first)
    printed = next(line for line in reports[1].splitlines() if "pretrain_bert_moe.py" in line)
    flags = printed.split("pretrain_bert_moe.py", 1)[1].split("--data-path")[0].split()
    trained = launch(1, tiny_gpt_args(bert_data, **{"train-iters": 1}) + flags, tmp_path,
                     script=BERT)
    assert trained.returncode == 0, trained.output[-4000:]
    assert "holds weights only" in trained.output
    assert trained.loss()[0] < straight.loss()[0] - 0.2  # the trained weights, batch 1



def test_bert_without_moe_exports_to_megatron_bert(bert_data, tmp_path):
    """A BERT with no MoE layers is what transformers' MegatronBertForPreTraining computes:
    its masked-LM and sentence-order logits equal the project's (1e-4), padding included."""
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    run = launch(1, tiny_gpt_args(bert_data, **{"num-experts": None, "train-iters": 2,
                                               "save": ckpt}), tmp_path, script=BERT)
    assert run.returncode == 0, run.output[-4000:]
    run_tool("tools/checkpoint/convert.py", "--loader", "parm", "--saver", "hf",
             "--load-dir", ckpt, "--save-dir", hf)
    from transformers import MegatronBertForPreTraining

    model, info = MegatronBertForPreTraining.from_pretrained(hf, dtype=torch.float32,
                                                             output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, 1900, (3, 40), generator=generator)
    types = (torch.arange(40) >= 20).long().expand(3, 40).contiguous()
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 30:] = 0  # a padded sample
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({"tokens": tokens.tolist(), "types": types.tolist(),
                                  "mask": mask.tolist()}))
    result = python("tests/worker_project_logits.py", ckpt, inputs, tmp_path / "logits.pt")
    assert result.returncode == 0, result.stderr[-3000:]
    lm, binary = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        theirs = model(tokens, attention_mask=mask, token_type_ids=types)
    vocab = model.config.vocab_size
    real = mask.bool()
    assert (lm[..., :vocab][real] - theirs.prediction_logits[real]).abs().max() <= 1e-4
    assert (binary - theirs.seq_relationship_logits).abs().max() <= 1e-4


def test_tokenizer_without_bert_tokens(bert_data, tmp_path):
    lines = (bert_data["dir"] / "corpus.jsonl").read_text().splitlines()[:50]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(tmp_path / "plain"), vocab_size=300,
        minloglevel=2)  # sentencepiece's defaults: no [CLS]/[SEP]/[MASK], no pad
    args = tiny_gpt_args(bert_data, **{"tokenizer-model": tmp_path / "plain.model"})
    run = launch(2, args, tmp_path, timeout=120, script=BERT)
    assert_clean_failure(run, "plain.model", "[CLS], [SEP], [MASK], <pad>",
                         "tools/train_tokenizer.py")


def test_document_level_dataset(gpt_data, tmp_path):
    run = launch(2, tiny_gpt_args(gpt_data), tmp_path, timeout=120, script=BERT)
    assert_clean_failure(run, gpt_data["prefix"], "document-level", "--split-sentences")


def _write_dataset(prefix, documents):
    """documents: lists of sentence lengths; token ids 10, 11, ... in order."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(1000))
    token = 10
    for lengths in documents:
        ids = list(range(token, token + sum(lengths)))
        token += sum(lengths)
        builder.add_document(ids, lengths)
    builder.finalize(f"{prefix}.idx")


def test_split_without_sentence_pairs_is_refused(bert_data, tmp_path):
    """megatron.core would search 2^31 epochs for pairs in a split whose documents all have one
    sentence (or a sentence over 512 tokens): refused instead, naming the split."""
    prefix = str(tmp_path / "pairs_text_sentence")
    # 18 training documents with pairs, then 2 validation documents without
    _write_dataset(prefix, [[5, 6, 7]] * 18 + [[9], [4, 600]])
    tokenizer = build_tokenizer("SentencePieceTokenizer", bert_data["tokenizer"])
    with pytest.raises(DataError, match="none of the 2 documents of the valid split"):
        build_bert_datasets([prefix], "90,10,0", 32, 1, tokenizer, (4, 4, None),
                            data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_bert_datasets([prefix], "90,10,0", 32, 1, tokenizer, (4, 4, None),
                                      binary_head=False, data_cache_path=str(tmp_path / "cache"))
    sample = train[0]  # masked LM only: one-sentence documents are fine, with no B segment
    assert sample["text"][0] == tokenizer.cls and (sample["types"] == 0).all()


def test_samples_are_bert_pairs(bert_data, tmp_path):
    """[CLS] A [SEP] B [SEP], segments 0 then 1, 15% of the real tokens masked, and the
    sentence order swapped for about half of the samples."""
    tokenizer = build_tokenizer("SentencePieceTokenizer", bert_data["tokenizer"])
    train, _, _ = build_bert_datasets([bert_data["prefix"]], "90,5,5", 64, 1234, tokenizer,
                                      (200, 8, 8), data_cache_path=str(tmp_path / "cache"))
    samples = [train[i] for i in range(200)]
    masked = real = 0
    for sample in samples:
        text, types, loss_mask = sample["text"], sample["types"], sample["loss_mask"]
        # (megatron's random replacement may draw the pad id, so count up to the last real token)
        length = int(numpy.flatnonzero(sample["padding_mask"])[-1]) + 1
        sep = numpy.flatnonzero((text[:length] == tokenizer.sep) & (loss_mask[:length] == 0))
        assert text[0] == tokenizer.cls and sep[-1] == length - 1 and len(sep) == 2, text
        assert (types[:sep[0] + 1] == 0).all() and (types[sep[0] + 1:length] == 1).all()
        positions = numpy.flatnonzero(loss_mask)
        assert (sample["labels"][positions] >= 0).all() and (positions < length).all()
        masked, real = masked + len(positions), real + length
    assert 0.12 < masked / real < 0.16, masked / real
    assert 0.35 < numpy.mean([s["is_random"] for s in samples]) < 0.65
