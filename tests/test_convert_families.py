"""tools/checkpoint/convert.py on the Qwen2-MoE, Qwen3-MoE and OLMoE families against
transformers' own models, and the model flags they need (--add-qkv-bias, --qk-layernorm,
--qk-layernorm-across-heads).

A random model of each family made by transformers (its vectors drawn too: QKV biases, norm
weights) imports: the project's logits are transformers' on one rank and under TP2 x PP2 x
EP2 (ESP1), its greedy continuation generate()'s on one rank (tools/generate.py) and under
that layout, and the import exports back bit for bit. A model the project trains with each
family's features under TP2 x EP2 with sequence parallelism exports to the family's class,
which transformers loads with no missing or unexpected keys and the logits the project's
model has under TP2 x PP2 x EP2. A checkpoint with --qk-layernorm --add-qkv-bias resumes
under another layout with the same losses. One launch runs every checkpoint under the 4-rank
layout.
"""

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import sentencepiece
import torch

from bad_input_fixtures import assert_refused, pretrain_argv
from conftest import ROOT, free_port, launch, max_relative, python, tiny_gpt_args, torchrun
from test_convert import project_logits
import test_models_init

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from safetensors.torch import load_file
    import transformers

COMMON = dict(vocab_size=2000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
              max_position_embeddings=64, initializer_range=0.1,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# model_type -> (class, its config's own entries, what the printed command line must hold)
FAMILIES = {
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(
        intermediate_size=80, moe_intermediate_size=48, shared_expert_intermediate_size=40,
        mlp_only_layers=[0], norm_topk_prob=True),
        ["--add-qkv-bias", "--moe-shared-expert-intermediate-size 40",
         "--moe-shared-expert-gate", "--moe-layer-freq [0,1,1,1]"]),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(
        intermediate_size=80, moe_intermediate_size=48, mlp_only_layers=[2], head_dim=24,
        norm_topk_prob=False), ["--qk-layernorm", "--kv-channels 24",
                                "--moe-router-pre-softmax", "--moe-layer-freq [1,1,0,1]"]),
    "olmoe": ("OlmoeForCausalLM", dict(intermediate_size=48, norm_topk_prob=False),
              ["--qk-layernorm --qk-layernorm-across-heads", "--moe-router-pre-softmax"]),
}
# the features each family's class holds, as the project trains them (TP2 x EP2, SP)
SHAPE = {"normalization": "RMSNorm", "swiglu": True, "position-embedding-type": "rope",
         "group-query-attention": True, "num-query-groups": 2, "moe-ffn-hidden-size": 48}
TRAINED = {
    "qwen2_moe": {"add-qkv-bias": True, "moe-shared-expert-intermediate-size": 32,
                  "moe-shared-expert-gate": True, "moe-layer-freq": "[0,1]"},
    "qwen3_moe": {"qk-layernorm": True, "add-qkv-bias": True, "moe-layer-freq": "[1,0]",
                  "kv-channels": 24, "train-iters": 4, "save-interval": 2},
    "olmoe": {"qk-layernorm": True, "qk-layernorm-across-heads": True},
}
TRAIN_LAYOUT = {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
                "sequence-parallel": True}
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
PROMPT = "The module"


def convert(*args):
    return python("tools/checkpoint/convert.py", *args)


def _random_model(model_type, directory, tokenizer):
    """A random model of the family, its 1-D tensors (biases, norm weights) off their initial
    zeros and ones, saved by transformers with the SentencePiece model beside it."""
    name, extra, _ = FAMILIES[model_type]
    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer)
    config = transformers.AutoConfig.for_model(model_type, **COMMON, **extra,
                                               bos_token_id=sp.bos_id(),
                                               eos_token_id=sp.eos_id())
    torch.manual_seed(0)
    model = getattr(transformers, name)(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.2 * torch.randn_like(param))
    model.eval().save_pretrained(directory)
    shutil.copyfile(tokenizer, directory / "tokenizer.model")
    return model


def _sequences(gpt_data, count=3, length=40):
    sp = sentencepiece.SentencePieceProcessor(model_file=gpt_data["tokenizer"])
    texts = [json.loads(line)["text"] for line in
             open(gpt_data["dir"] / "corpus.jsonl").read().splitlines()[:count]]
    return [sp.encode(text)[:length] for text in texts]


def _once(tmp_path_factory, name, build):
    """build(folder), a JSON-able summary of what it made there, run once a session: under
    pytest -n the first worker to ask builds it in the workers' common folder while the others
    wait, and each reads the summary."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp(name))
    import fcntl

    shared = tmp_path_factory.getbasetemp().parent  # the workers' common pytest-N folder
    folder, summary = shared / name, shared / f"{name}.json"
    with open(shared / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not summary.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed half-way
            folder.mkdir()
            summary.write_text(json.dumps(build(folder)))
    return json.loads(summary.read_text())


def _build(tmp, gpt_data):
    """Each family's random model imported and exported back; a model with each family's
    features trained on 4 ranks and exported; every checkpoint under TP2 x PP2 x EP2 in one
    launch."""
    sequences = _sequences(gpt_data)
    out = {"sequences": sequences, "imported": {}, "trained": {}}
    for model_type in FAMILIES:
        original, ckpt, back = (tmp / f"{model_type}{end}" for end in ("", "_imported", "_back"))
        _random_model(model_type, original, gpt_data["tokenizer"])
        result = convert("--loader", "hf", "--saver", "parm", "--load-dir", original,
                         "--save-dir", ckpt)
        assert result.returncode == 0, result.stderr[-3000:]
        exported = convert("--loader", "parm", "--saver", "hf", "--load-dir", ckpt,
                           "--save-dir", back)
        assert exported.returncode == 0, exported.stderr[-3000:]
        out["imported"][model_type] = {"original": str(original), "ckpt": str(ckpt),
                                       "back": str(back),
                                       "printed": result.stdout + exported.stdout}
    for model_type, features in TRAINED.items():
        ckpt, hf = tmp / f"{model_type}_trained", tmp / f"{model_type}_trained_hf"
        flags = {**SHAPE, **TRAIN_LAYOUT, "train-iters": 2, **features, "save": ckpt}
        run = launch(4, tiny_gpt_args(gpt_data, **flags), tmp)
        assert run.returncode == 0, run.output[-4000:]
        one = launch(1, tiny_gpt_args(gpt_data, **{**SHAPE, **features, "train-iters": 2,
                                                   "save-interval": None}), tmp)
        assert one.returncode == 0, one.output[-4000:]
        result = convert("--loader", "parm", "--saver", "hf", "--load-dir", ckpt,
                         "--save-dir", hf)
        assert result.returncode == 0, result.stderr[-3000:]
        out["trained"][model_type] = {
            "ckpt": str(ckpt), "hf": str(hf), "losses": run.loss(),
            "grad_norms": run.loss("grad norm"), "one_rank": one.loss(),
            "one_rank_grad_norms": one.loss("grad norm")}
    checkpoints = [entry["ckpt"] for kind in ("imported", "trained")
                   for entry in out[kind].values()]
    jobs = [{"load": ckpt, "tokens": sequences, "out": str(tmp / f"layout_{i}.pt")}
            for i, ckpt in enumerate(checkpoints)]
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    status, output = torchrun(["--nproc-per-node", "4", "--master-port", free_port(),
                               "tests/worker_family_layout.py", tmp / "jobs.json", PROMPT,
                               *LAYOUT])
    assert status == 0, output[-4000:]
    out["layout"] = {job["load"]: job["out"] for job in jobs}
    return out


@pytest.fixture(scope="module")
def families(gpt_data, tmp_path_factory):
    return _once(tmp_path_factory, "families", lambda tmp: _build(tmp, gpt_data))


def _under_layout(families, ckpt):
    """The checkpoint's logits and greedy ids under TP2 x PP2 x EP2."""
    return torch.load(families["layout"][ckpt])


def _transformers(directory):
    name = json.loads((Path(directory) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, name).from_pretrained(directory, dtype=torch.float32,
                                                       output_loading_info=True)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_import_has_transformers_logits_on_one_rank_and_under_tp_pp_ep(
        model_type, families, tmp_path):
    made, sequences = families["imported"][model_type], families["sequences"]
    for flags in FAMILIES[model_type][2]:
        assert flags in made["printed"], made["printed"]
    model, _ = _transformers(made["original"])
    assert type(model).__name__ == FAMILIES[model_type][0]
    with torch.no_grad():
        theirs = model(torch.tensor(sequences)).logits
    assert theirs.abs().max() > 0.5  # weights that make the logits depend on every tensor
    one = project_logits(made["ckpt"], sequences, tmp_path / "logits.pt")
    assert (one[..., :COMMON["vocab_size"]] - theirs).abs().max() <= 1e-4
    assert (_under_layout(families, made["ckpt"])["logits"] - theirs).abs().max() <= 1e-4


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_generation_is_transformers(model_type, families):
    made = families["imported"][model_type]
    status, output = torchrun(["--nproc-per-node", "1", "--master-port", free_port(),
                               "tools/generate.py", "--load-dir", made["ckpt"], "--prompt",
                               PROMPT, "--max-new-tokens", "20"])
    assert status == 0, output[-3000:]
    lines = output.splitlines()
    prompt = [int(i) for i in next(l for l in lines if l.startswith("prompt ids: ")).split()[2:]]
    ours = [int(i) for i in next(l for l in lines if l.startswith("ids: ")).split()[1:]]
    model, _ = _transformers(made["original"])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
    theirs = out[0, len(prompt):].tolist()
    assert len(ours) == 20 or ours[-1] == model.config.eos_token_id
    assert ours == theirs
    assert _under_layout(families, made["ckpt"])["ids"] == theirs


@pytest.mark.parametrize("model_type", FAMILIES)
def test_export_of_the_import_is_bit_exact(model_type, families):
    made = families["imported"][model_type]
    assert f"{FAMILIES[model_type][0]}, with its tokenizer" in made["printed"]
    before = load_file(Path(made["original"]) / "model.safetensors")
    after = load_file(Path(made["back"]) / "model.safetensors")
    assert sorted(before) == sorted(after)
    for key, tensor in before.items():
        assert torch.equal(tensor, after[key]), key


@pytest.mark.parametrize("model_type", TRAINED)
def test_trained_model_exports_to_its_family(model_type, families):
    made = families["trained"][model_type]
    model, info = _transformers(made["hf"])
    assert type(model).__name__ == FAMILIES[model_type][0]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        theirs = model(torch.tensor(families["sequences"])).logits
    # saved under TP2 x EP2 with SP, loaded on one rank (the export) and under TP2 x PP2 x EP2
    assert (_under_layout(families, made["ckpt"])["logits"] - theirs).abs().max() <= 1e-4


@pytest.mark.parametrize("model_type", TRAINED)
def test_features_train_alike_on_one_rank_and_under_tp_ep_sp(model_type, families):
    """Each family's features (the shared expert and its gate, the QKV bias, the query/key
    norms per head and across heads) under TP2 x EP2 with SP: one rank's losses and gradient
    norms (a norm across heads whose sums of squares took no gradient back over the TP group
    is off by 1e-4 in the first gradient norm)."""
    made = families["trained"][model_type]
    count = len(made["one_rank"])
    assert count == 2 and len(made["losses"]) >= count
    assert max_relative(made["losses"][:count], made["one_rank"]) < 1e-6
    assert max_relative(made["grad_norms"][:count], made["one_rank_grad_norms"]) < 3e-5


def test_transformers_4_loads_the_exports(families):
    """The exports of the imports load in transformers 4.x (make setup installs one beside
    5.x) as the same class with 5.x's logits."""
    sequences = families["sequences"]
    directories = [made["back"] for made in families["imported"].values()]
    run = subprocess.run(
        [sys.executable, "tests/worker_transformers4.py",
         json.dumps([[d, sequences, [PROMPT]] for d in directories])],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / ".venv" / "transformers4"),
             "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, run.stderr[-3000:]
    old = json.loads(run.stdout.splitlines()[-1])
    for directory in directories:
        model, _ = _transformers(directory)
        with torch.no_grad():
            new = model(torch.tensor(sequences)).logits
        assert old[directory]["class"] == type(model).__name__
        assert (torch.tensor(old[directory]["logits"]) - new).abs().max() <= 1e-5, directory


def test_qk_layernorm_and_qkv_bias_resume_under_another_layout(families, gpt_data, tmp_path):
    """Saved at iteration 2 under TP2 x EP2 with SP, resumed under PP2 on 2 ranks: the same
    iterations 3 and 4."""
    made = families["trained"]["qwen3_moe"]
    at_2 = tmp_path / "at_2"
    at_2.mkdir()
    (at_2 / "iter_0000002").symlink_to(Path(made["ckpt"]) / "iter_0000002")
    (at_2 / "latest_checkpointed_iteration.txt").write_text("2")
    flags = {**SHAPE, **TRAINED["qwen3_moe"], "pipeline-model-parallel-size": 2,
             "load": at_2, "save-interval": None}
    resumed = launch(2, tiny_gpt_args(gpt_data, **flags), tmp_path)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert f"resumed from {at_2} at iteration 2" in resumed.output, resumed.output[-4000:]
    assert len(made["losses"]) == 4 and len(resumed.loss()) == 2
    assert max_relative(resumed.loss(), made["losses"][2:]) < 1e-3


# --- refusals: one line, nothing written ----------------------------------------------------

GPT_ARGS = {"num_experts": 4, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
            "disable_bias_linear": True, "moe_ffn_hidden_size": 48, "moe_layer_freq": 1,
            "untie_embeddings_and_output_weights": False}
NOT_EXPORTED = {
    "shared_without_gate": ({"moe_shared_expert_intermediate_size": 32},
                            "Qwen2MoeForCausalLM's shared expert always has its sigmoid gate"),
    "qk_norm_and_shared": ({"qk_layernorm": True, "moe_shared_expert_intermediate_size": 32},
                           "Qwen3MoeForCausalLM has no shared expert"),
    "across_heads_dense": ({"qk_layernorm": True, "qk_layernorm_across_heads": True,
                            "moe_layer_freq": [0, 1]}, "every OlmoeForCausalLM layer is MoE"),
    "sigmoid_router": ({"moe_router_score_function": "sigmoid"},
                       "--moe-router-score-function 'sigmoid'"),
}
NOT_IMPORTED = {
    "qwen2_sliding_window": ("qwen2_moe", {"use_sliding_window": True},
                             "use_sliding_window true: attention over a window"),
    "qwen3_sliding_window": ("qwen3_moe", {"use_sliding_window": True},
                             "use_sliding_window true: attention over a window"),
    "olmoe_clip_qkv": ("olmoe", {"clip_qkv": 8.0}, "clip_qkv 8.0: the project's attention"),
    "gelu": ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
}


def test_convert_refuses_what_no_class_or_model_expresses(entry, capsys, tmp_path):
    main = entry("tools/checkpoint/convert.py")
    out = tmp_path / "out"
    for case, (changes, needle) in NOT_EXPORTED.items():
        ckpt = tmp_path / case
        (ckpt / "iter_0000002").mkdir(parents=True)
        (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
        (ckpt / "iter_0000002" / "run.json").write_text(
            json.dumps({"model": "gpt", "args": {**GPT_ARGS, **changes}}))
        assert_refused(main, ["--loader", "parm", "--saver", "hf", "--load-dir", ckpt,
                              "--save-dir", out], capsys, 1, needle)
        assert not out.exists() and not (tmp_path / "out.partial").exists()
    for case, (model_type, changes, needle) in NOT_IMPORTED.items():
        directory = tmp_path / case
        transformers.AutoConfig.for_model(model_type, **COMMON, **FAMILIES[model_type][1],
                                          **changes).save_pretrained(directory)
        assert_refused(main, ["--loader", "hf", "--saver", "parm", "--load-dir", directory,
                              "--save-dir", out], capsys, 1, needle)
        assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_convert_refuses_an_output_bias(gpt_data, tmp_path):
    """Qwen3-MoE's attention_bias biases the output projection too: only a zero one imports
    (--add-qkv-bias)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("qwen3_moe", **COMMON,
                                               **FAMILIES["qwen3_moe"][1], attention_bias=True)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.bias[5] = 0.5
    model.save_pretrained(tmp_path / "biased")
    out = tmp_path / "out"
    result = convert("--loader", "hf", "--saver", "parm", "--load-dir", tmp_path / "biased",
                     "--save-dir", out, "--tokenizer-model", gpt_data["tokenizer"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert "model.layers.1.self_attn.o_proj.bias (shape [64]) is not zero" in errors[0]
    assert not out.exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("flags, needle", [
    (["--qk-layernorm-across-heads"], "--qk-layernorm-across-heads needs --qk-layernorm"),
    (["--qk-layernorm", "--qk-layernorm-across-heads"],
     "--qk-layernorm-across-heads needs --normalization RMSNorm"),
    (["--qk-layernorm", "--qk-layernorm-across-heads", "--normalization", "RMSNorm",
      "--multi-latent-attention"], "--qk-layernorm-across-heads with --multi-latent-attention"),
])
def test_pretrain_refuses_norms_across_heads_without_their_kind(entry, gpt_data, capsys,
                                                                flags, needle):
    assert_refused(entry("pretrain_gpt_moe.py"), pretrain_argv(gpt_data, *flags), capsys, 1,
                   needle)


# --- the parameters the memory estimate counts -------------------------------------------------

@pytest.mark.parametrize("extra", [
    [], ["--add-qkv-bias"], ["--qk-layernorm"], ["--qk-layernorm", "--normalization", "LayerNorm"],
    ["--qk-layernorm", "--qk-layernorm-across-heads", "--add-qkv-bias"],
    ["--group-query-attention", "--num-query-groups", "2", "--kv-channels", "12",
     "--qk-layernorm", "--add-qkv-bias"],
])
def test_memory_estimate_counts_the_layers_parameters(one_rank_world, extra):
    """An MoE layer's parameters in the cost model (planning/model_cost.py, which the memory
    estimate and the stage builder read) are the built model's."""
    from parm_trainer.moe.cost_profile import DEFAULT_PROFILE
    from parm_trainer.planning.model_cost import ModelCost

    flags = ["--normalization", "RMSNorm", *extra]
    args, model = test_models_init.build_tiny(0, *flags)
    built = sum(p.numel() for name, p in model.named_parameters()
                if name.startswith("decoder.layers.0."))
    counted = ModelCost(args, DEFAULT_PROFILE).layer(True).params
    norms = 2 * args.hidden_size if "LayerNorm" in extra else 0  # the layer norms' biases
    assert counted + norms == built
