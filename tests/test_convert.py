"""tools/checkpoint/convert.py and tools/generate.py against Hugging Face transformers.

A Mixtral-shaped GPT-MoE (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases) trained
under TP2 x EP2 x ESP2 + SP exports to a MixtralForCausalLM that transformers loads with no
missing or unexpected keys and whose logits and greedy continuation (generated on 1 rank and
under PP2 x TP2 x EP2 x ESP1) are the project's own; a Mixtral made by transformers
imports, trains under another layout with one rank's losses, and exports back bit for bit. A
Qwen2-MoE (the class for --moe-router-pre-softmax and dense layers between MoE layers) does the
same round trip with the same logits (tests/test_convert_families.py: its shared expert and
QKV biases, Qwen3-MoE and OLMoE). transformers 4.x (make setup installs one beside 5.x)
loads both exports with 5.x's logits and tokenizer ids. Refusals are one line and leave nothing
behind.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import sentencepiece
import torch

import megatron_recipes as recipes
from conftest import ROOT, free_port, launch, max_relative, python, tiny_gpt_args, torchrun

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from safetensors.torch import load_file
    from transformers import (AutoTokenizer, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM)

MIXTRAL_SHAPE = {"normalization": "RMSNorm", "swiglu": True, "position-embedding-type": "rope",
                 "group-query-attention": True, "num-query-groups": 2,
                 "moe-ffn-hidden-size": 96}
LAYOUT = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
          "expert-tensor-parallel-size": 2, "sequence-parallel": True,
          "use-distributed-optimizer": True}
PROMPT = "The module"


def convert(*args, timeout=300):
    return python("tools/checkpoint/convert.py", *args, timeout=timeout)


def generate(nproc, load_dir, *layout, timeout=300):
    status, output = torchrun(["--nproc-per-node", nproc, "--master-port", free_port(),
                               "tools/generate.py", "--load-dir", load_dir, "--prompt", PROMPT,
                               "--max-new-tokens", "20", *layout], timeout=timeout)
    assert status == 0, output[-3000:]
    lines = output.splitlines()
    ids = next(l for l in lines if l.startswith("ids: "))
    prompt = next(l for l in lines if l.startswith("prompt ids: "))
    return [int(i) for i in prompt.split()[2:]], [int(i) for i in ids.split()[1:]]


@pytest.fixture(scope="module")
def exported(gpt_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    ckpt, hf = tmp / "ckpt", tmp / "hf"
    run = launch(4, tiny_gpt_args(gpt_data, **MIXTRAL_SHAPE, **LAYOUT,
                                  **{"train-iters": 6, "save": ckpt}), tmp)
    assert run.returncode == 0, run.output[-4000:]
    result = convert("--loader", "parm", "--saver", "hf", "--load-dir", ckpt, "--save-dir", hf)
    assert result.returncode == 0, result.stderr[-3000:]
    return ckpt, hf, tmp


def project_logits(ckpt, sequences, out):
    """The project's model on one rank (as the converter loads it), in a process of its own."""
    inputs = out.with_suffix(".json")
    inputs.write_text(json.dumps({"tokens": sequences}))
    run = python("tests/worker_project_logits.py", ckpt, inputs, out)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)


def test_export_loads_in_transformers_with_the_same_logits(exported, gpt_data):
    ckpt, hf, tmp = exported
    model, info = MixtralForCausalLM.from_pretrained(hf, dtype=torch.float32,
                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    sp = sentencepiece.SentencePieceProcessor(model_file=gpt_data["tokenizer"])
    assert model.config.vocab_size == sp.vocab_size()
    corpus = [json.loads(line)["text"] for line in
              open(gpt_data["dir"] / "corpus.jsonl").read().splitlines()[:40]]
    sequences = [sp.encode(text)[:48] for text in corpus[:4]]
    assert all(len(s) == 48 for s in sequences)
    ours = project_logits(ckpt, sequences, tmp / "logits.pt")[..., :sp.vocab_size()]
    with torch.no_grad():
        theirs = model(torch.tensor(sequences)).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1e-4

    tokenizer = AutoTokenizer.from_pretrained(hf)
    for text in corpus + ["  two  spaces\tand a tab 1234 ünï <s> [MASK]"]:
        assert tokenizer(text)["input_ids"] == sp.encode(text), text


def test_greedy_generation_matches_transformers(exported):
    ckpt, hf, _ = exported
    prompt_ids, ours_one = generate(1, ckpt)
    _, ours_four = generate(4, ckpt, "--pipeline-model-parallel-size", "2",
                                 "--tensor-model-parallel-size", "2",
                                 "--expert-model-parallel-size", "2",
                                 "--expert-tensor-parallel-size", "1")
    model = MixtralForCausalLM.from_pretrained(hf, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert tokenizer(PROMPT)["input_ids"] == prompt_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=20, do_sample=False)
    theirs = out[0, len(prompt_ids):].tolist()
    assert len(ours_one) == 20 or ours_one[-1] == model.config.eos_token_id
    assert ours_one == theirs
    assert ours_four == theirs


def test_mixtral_round_trip_and_training(gpt_data, tmp_path):
    config = MixtralConfig(vocab_size=2048, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, rope_theta=10000.0)
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(tmp_path / "original")
    # as examples/mixtral/README.md of Megatron-LM converts it (its flag names)
    imported = convert(*recipes.with_variables(recipes.MIXTRAL_CONVERT, {
        "TARGET_TP_SIZE": 1, "TARGET_PP_SIZE": 4, "TARGET_EP_SIZE": 8,
        "HF_FORMAT_DIR": tmp_path / "original", "MEGATRON_FORMAT_DIR": tmp_path / "imported",
        "TOKENIZER_MODEL": gpt_data["tokenizer"]}))
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert "parallel-size: no effect here" in imported.stdout
    result = convert("--loader", "parm", "--saver", "hf", "--load-dir", tmp_path / "imported",
                     "--save-dir", tmp_path / "back")
    assert result.returncode == 0, result.stderr[-3000:]
    original = load_file(tmp_path / "original" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(original) == sorted(back)
    for key, tensor in original.items():
        assert torch.equal(tensor, back[key]), key

    # the printed command line builds the model; train it on 1 rank and on 4
    printed = next(l for l in imported.stdout.splitlines() if "pretrain_gpt_moe.py" in l)
    model_flags = printed.split("pretrain_gpt_moe.py", 1)[1].split("--data-path")[0].split()
    unset = {flag: None for flag in ("num-layers", "hidden-size", "num-attention-heads",
                                     "max-position-embeddings", "num-experts", "moe-router-topk",
                                     "tokenizer-model")}
    base = tiny_gpt_args(gpt_data, **unset, **{"train-iters": 3})
    one = launch(1, base + model_flags, tmp_path)
    assert one.returncode == 0, one.output[-4000:]
    assert "holds weights only" in one.output
    layout = [f"--{k}" if v is True else f"--{k} {v}" for k, v in LAYOUT.items()]
    four = launch(4, base + model_flags + " ".join(layout).split(), tmp_path)
    assert four.returncode == 0, four.output[-4000:]
    assert max_relative(four.loss(), one.loss()) <= 1e-4


def test_refusals_are_one_line_and_leave_nothing(exported, gpt_data, tmp_path):
    ckpt, hf, _ = exported
    # a checkpoint whose run.json describes the tiny model's defaults (LayerNorm, GELU, learned
    # positions): refused from the description, before any tensor is read
    layer_norm = tmp_path / "layer_norm"
    (layer_norm / "iter_0000006").mkdir(parents=True)
    (layer_norm / "latest_checkpointed_iteration.txt").write_text("6")
    description = json.loads((ckpt / "iter_0000006" / "run.json").read_text())
    description["args"].update(normalization="LayerNorm", swiglu=False,
                               position_embedding_type="learned_absolute")
    (layer_norm / "iter_0000006" / "run.json").write_text(json.dumps(description))
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out = tmp_path / "out"
    cases = [
        (("parm", "hf", layer_norm, out), "--normalization is 'LayerNorm'"),
        (("parm", "hf", tmp_path, out), "is not a parm_trainer checkpoint directory"),
        (("hf", "parm", llama, out), "model_type 'llama'"),
        (("hf", "parm", tmp_path, out), "is not a Hugging Face model directory"),
        (("parm", "hf", ckpt, hf), "exists"),
    ]
    before = sorted(p.name for p in hf.iterdir())
    for (loader, saver, load_dir, save_dir), needle in cases:
        result = convert("--loader", loader, "--saver", saver, "--load-dir", load_dir,
                         "--save-dir", save_dir)
        assert result.returncode == 1, result.stdout + result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and needle in errors[0], result.stderr[-2000:]
        assert "Traceback" not in result.stderr
        assert not out.exists() and not (tmp_path / "out.partial").exists()
    assert sorted(p.name for p in hf.iterdir()) == before


QWEN2_MOE = dict(vocab_size=2048, hidden_size=64, intermediate_size=80, moe_intermediate_size=48,
                 shared_expert_intermediate_size=0, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                 mlp_only_layers=[1, 3], norm_topk_prob=False, max_position_embeddings=64,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _qwen2_moe(directory, **changes):
    """A random Qwen2-MoE in the form the project's model holds: QKV biases and the (empty)
    shared expert's gate zero."""
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**QWEN2_MOE, **changes}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias") or "shared_expert_gate" in name:
                param.zero_()
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def qwen2(gpt_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen2")
    model = _qwen2_moe(tmp / "original")
    imported = convert("--loader", "hf", "--saver", "parm", "--load-dir", tmp / "original",
                       "--save-dir", tmp / "imported", "--tokenizer-model", gpt_data["tokenizer"])
    assert imported.returncode == 0, imported.stderr[-3000:]
    back = convert("--loader", "parm", "--saver", "hf", "--load-dir", tmp / "imported",
                   "--save-dir", tmp / "back")
    assert back.returncode == 0, back.stderr[-3000:]
    return model, imported.stdout, back.stdout, tmp


def _sequences(gpt_data, count=4, length=48):
    sp = sentencepiece.SentencePieceProcessor(model_file=gpt_data["tokenizer"])
    texts = [json.loads(line)["text"] for line in
             open(gpt_data["dir"] / "corpus.jsonl").read().splitlines()[:count]]
    return [sp.encode(text)[:length] for text in texts]


def test_qwen2_moe_round_trip_with_the_same_logits(qwen2, gpt_data):
    model, imported, back, tmp = qwen2
    assert "--moe-router-pre-softmax" in imported and "--moe-layer-freq 2" in imported
    assert "Qwen2MoeForCausalLM" in back
    original = load_file(tmp / "original" / "model.safetensors")
    exported = load_file(tmp / "back" / "model.safetensors")
    assert sorted(original) == sorted(exported)
    for key, tensor in original.items():
        assert torch.equal(tensor, exported[key]), key
    sequences = _sequences(gpt_data)
    ours = project_logits(tmp / "imported", sequences, tmp / "logits.pt")[..., :2048]
    with torch.no_grad():
        theirs = model(torch.tensor(sequences)).logits
    assert (ours - theirs).abs().max() <= 1e-4


def test_qwen2_moe_refusals(gpt_data, tmp_path):
    """A shared expert of width 0 has no output whatever its gate; the project's model, which
    then has no shared expert, imports only a zero gate (and so exports back bit for bit)."""
    gated = _qwen2_moe(tmp_path / "gated")
    with torch.no_grad():
        gated.model.layers[2].mlp.shared_expert_gate.weight[0, 3] = 0.5
    gated.save_pretrained(tmp_path / "gated")
    for directory, needle in (("gated", "model.layers.2.mlp.shared_expert_gate.weight"),):
        out = tmp_path / f"{directory}_out"
        result = convert("--loader", "hf", "--saver", "parm", "--load-dir", tmp_path / directory,
                         "--save-dir", out, "--tokenizer-model", gpt_data["tokenizer"])
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert result.returncode == 1 and len(errors) == 1 and needle in errors[0], result.stderr
        assert not out.exists() and not (tmp_path / f"{directory}_out.partial").exists()


TRANSFORMERS_4 = ROOT / ".venv" / "transformers4"


def test_transformers_4_loads_both_exports(exported, qwen2, gpt_data):
    """The exports load in transformers 4.x as in 5.x: same class, logits, tokenizer ids."""
    assert (TRANSFORMERS_4 / "transformers").is_dir(), "run make setup (installs transformers 4)"
    sequences = _sequences(gpt_data)
    texts = [json.loads(line)["text"][:300] for line in
             open(gpt_data["dir"] / "corpus.jsonl").read().splitlines()[:5]]
    directories = [str(exported[1]), str(qwen2[3] / "back")]
    run = subprocess.run(
        [sys.executable, "tests/worker_transformers4.py",
         json.dumps([[d, sequences, texts] for d in directories])],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(TRANSFORMERS_4), "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, run.stderr[-3000:]
    old = json.loads(run.stdout.splitlines()[-1])
    sp = sentencepiece.SentencePieceProcessor(model_file=gpt_data["tokenizer"])
    for directory, name in zip(directories, ("MixtralForCausalLM", "Qwen2MoeForCausalLM")):
        model = getattr(__import__("transformers"), name).from_pretrained(directory,
                                                                          dtype=torch.float32)
        with torch.no_grad():
            new = model(torch.tensor(sequences)).logits
        assert old[directory]["class"] == name
        assert (torch.tensor(old[directory]["logits"]) - new).abs().max() <= 1e-5, directory
        assert old[directory]["ids"] == [sp.encode(text) for text in texts]


def test_a_bf16_run_exports_in_bf16(gpt_data, tmp_path):
    """A run trained with --bf16 keeps bf16 weights in its checkpoint: the export writes each
    tensor in the dtype the checkpoint holds (not float32, twice the size), config.json says
    bfloat16, the values are the checkpoint's bit for bit (read by torch's own checkpoint
    reader), and transformers loads it with no missing or unexpected keys."""
    import torch.distributed.checkpoint as dcp

    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    run = launch(1, tiny_gpt_args(gpt_data, **MIXTRAL_SHAPE, **{
        "train-iters": 2, "bf16": True, "untie-embeddings-and-output-weights": True,
        "save": ckpt}), tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    result = convert("--loader", "parm", "--saver", "hf", "--load-dir", ckpt, "--save-dir", hf)
    assert result.returncode == 0, result.stderr[-3000:]
    tensors = {}
    for shard in hf.glob("*.safetensors"):
        tensors.update(load_file(shard))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((hf / "config.json").read_text())["dtype"] == "bfloat16"
    path = str(ckpt / "iter_0000002")
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    stored = {key: torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
              for key in ("embedding.word_embeddings.weight", "output_layer.weight")}
    dcp.load(stored, checkpoint_id=path, no_dist=True)
    for ours, theirs in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                         ("output_layer.weight", "lm_head.weight")):
        assert stored[ours].dtype == torch.bfloat16
        vocab = tensors[theirs].shape[0]
        assert torch.equal(stored[ours][:vocab], tensors[theirs]), ours
    model, info = MixtralForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not any(info.values()), info
    assert model.dtype == torch.bfloat16
