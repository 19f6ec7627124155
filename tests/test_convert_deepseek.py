"""DeepSeek-V3 (multi-latent attention, sigmoid group-limited routing with the expert bias,
shared experts, dense first layers, YaRN) against Hugging Face transformers.

A random DeepseekV3ForCausalLM made by transformers, saved in shards with
model.safetensors.index.json, imports with transformers' logits (one rank; and under TP2 x PP2 x
EP2 with ESP 1, where its greedy continuation is transformers' too, as on one rank through
tools/generate.py) and exports back in shards (--max-shard-size), bit for bit; a checkpoint with
rope_interleave false imports to the same function (and exports with rope_interleave true to it
again, without shared experts too); what the project's model cannot compute alike is refused
in one line. A model trained with multi-latent attention under TP2 x EP2 x SP exports to a DeepseekV3ForCausalLM transformers loads with no missing or unexpected keys,
whose logits the checkpoint gives when loaded under TP2 x PP2 x EP2 (another layout).
"""

import json
import shutil
import warnings

import pytest
import sentencepiece
import torch

from conftest import free_port, launch, tiny_gpt_args, torchrun
from test_convert import PROMPT, project_logits, _sequences, convert, generate
from test_convert_stream import _assert_same_weights, _weights

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()  # YaRN's note on original_max_position_embeddings

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096}
DEEPSEEK = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5,
                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
                qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
                first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=128,
                rope_parameters=YARN)
SHARD = "300KB"  # the model is about 2 MB: several shards both ways
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]


def _deepseek(directory, tokenizer, **changes):
    """A random DeepSeek-V3 saved by transformers in shards of SHARD, its norms, router and
    expert bias drawn too (transformers' init leaves them constant), with the SentencePiece
    tokenizer beside it."""
    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer)
    config = DeepseekV3Config(**{**DEEPSEEK, **changes}, vocab_size=sp.vocab_size(),
                              bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id())
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                param.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                param.normal_(0.0, 0.5)
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(directory, max_shard_size=SHARD)
    shutil.copyfile(tokenizer, directory / "tokenizer.model")
    return model


def _weights_files(directory) -> list:
    return sorted(path.name for path in directory.iterdir() if path.suffix == ".safetensors")


def _import(original, imported):
    result = convert("--loader", "hf", "--saver", "parm", "--load-dir", original,
                     "--save-dir", imported)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def deepseek(gpt_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepseek")
    model = _deepseek(tmp / "original", gpt_data["tokenizer"])
    printed = _import(tmp / "original", tmp / "imported")
    back = convert("--loader", "parm", "--saver", "hf", "--load-dir", tmp / "imported",
                   "--save-dir", tmp / "back", "--max-shard-size", SHARD)
    assert back.returncode == 0, back.stderr[-3000:]
    assert "DeepseekV3ForCausalLM" in back.stdout
    return model, printed, tmp


def test_import_has_transformers_logits_and_exports_bit_for_bit(deepseek, gpt_data):
    model, printed, tmp = deepseek
    for flags in ("--multi-latent-attention", "--q-lora-rank 24", "--kv-lora-rank 16",
                  "--qk-head-dim 16", "--qk-pos-emb-head-dim 8", "--v-head-dim 12",
                  "--qk-layernorm", "--rope-type yarn", "--rotary-scaling-factor 4.0",
                  "--mscale-all-dim 1.0", "--moe-layer-freq [0,1,1,1]",
                  "--moe-shared-expert-intermediate-size 32", "--moe-router-score-function "
                  "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-num-groups 2",
                  "--moe-router-group-topk 1", "--moe-router-topk-scaling-factor 2.5"):
        assert flags in printed, flags
    _assert_same_weights(tmp / "original", tmp / "back")
    assert len(_weights_files(tmp / "back")) > 2
    sequences = _sequences(gpt_data)
    ours = project_logits(tmp / "imported", sequences, tmp / "logits.pt")[..., :2000]
    with torch.no_grad():
        theirs = model(torch.tensor(sequences)).logits
    assert (ours - theirs).abs().max() <= 1e-4

    # the attention's parameters as the FLOP count and the cost model see them
    from parm_trainer.arguments import parse_args
    from parm_trainer.mla_flags import attention_sizes

    words = printed.split("pretrain_gpt_moe.py", 1)[1].split("--tokenizer-model")[0].split()
    sizes = attention_sizes(parse_args(words + ["--mock-data"], world_size=1))
    attention = sum(t.numel() for k, t in _weights(tmp / "original").items()
                    if "layers.0.self_attn." in k)
    assert sizes["split"] + sizes["whole"] == attention


def test_rope_interleave_false_imports_the_same_function(gpt_data, tmp_path):
    """Also without shared experts (n_shared_experts 0: tensors of width 0 both ways), exported
    back with rope_interleave true to the same function."""
    model = _deepseek(tmp_path / "original", gpt_data["tokenizer"], rope_interleave=False,
                      q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                      n_shared_experts=0,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    printed = _import(tmp_path / "original", tmp_path / "imported")
    assert "--q-lora-rank" not in printed and "--rope-type rope" in printed
    assert "--moe-router-num-groups" not in printed
    assert "--moe-shared-expert-intermediate-size" not in printed
    sequences = _sequences(gpt_data, count=2)
    ours = project_logits(tmp_path / "imported", sequences, tmp_path / "logits.pt")
    back = convert("--loader", "parm", "--saver", "hf", "--load-dir", tmp_path / "imported",
                   "--save-dir", tmp_path / "back", "--max-shard-size", SHARD)
    assert back.returncode == 0, back.stderr[-3000:]
    exported = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    assert exported.config.rope_interleave and exported.config.n_shared_experts == 0
    with torch.no_grad():
        theirs = model(torch.tensor(sequences)).logits
        again = exported(torch.tensor(sequences)).logits
    assert (ours[..., :2000] - theirs).abs().max() <= 1e-4
    assert (again - theirs).abs().max() <= 1e-4


@pytest.mark.parametrize("changes, needle", [
    (dict(attention_bias=True), "attention_bias true"),
    (dict(num_experts_per_tok=4, n_routed_experts=8, n_group=2, topk_group=1),
     "num_experts_per_tok 4 over topk_group 1"),
    (dict(norm_topk_prob=False), "norm_topk_prob false"),
    (dict(rope_parameters={**YARN, "beta_fast": 16.0}), "beta_fast 16.0"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps 1e-05"),
])
def test_refusals_are_one_line_and_leave_nothing(gpt_data, tmp_path, changes, needle):
    _deepseek(tmp_path / "original", gpt_data["tokenizer"], **changes)
    out = tmp_path / "out"
    result = convert("--loader", "hf", "--saver", "parm", "--load-dir", tmp_path / "original",
                     "--save-dir", out)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 1 and len(errors) == 1 and needle in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists() and not (tmp_path / "out.partial").exists()


MLA_FLAGS = {"normalization": "RMSNorm", "swiglu": True, "position-embedding-type": "rope",
             "norm-epsilon": 1e-6, "untie-embeddings-and-output-weights": True,
             "multi-latent-attention": True, "q-lora-rank": 16, "kv-lora-rank": 16,
             "qk-head-dim": 16, "qk-pos-emb-head-dim": 8, "v-head-dim": 12,
             "qk-layernorm": True, "rotary-scaling-factor": 4, "mscale-all-dim": 1,
             "moe-ffn-hidden-size": 32, "ffn-hidden-size": 96, "moe-layer-freq": "[0,1]",
             "moe-shared-expert-intermediate-size": 32, "moe-router-score-function": "sigmoid",
             "moe-router-enable-expert-bias": True, "moe-router-num-groups": 2,
             "moe-router-group-topk": 1, "moe-router-topk-scaling-factor": 2.5,
             "tensor-model-parallel-size": 2, "expert-model-parallel-size": 2,
             "sequence-parallel": True}


def test_trained_mla_exports_and_both_load_under_another_layout(deepseek, gpt_data, tmp_path):
    model, _, tmp = deepseek
    run = launch(4, tiny_gpt_args(gpt_data, **MLA_FLAGS, **{"train-iters": 4,
                                                            "save": tmp_path / "ckpt"}), tmp_path)
    assert run.returncode == 0, run.output[-4000:]
    result = convert("--loader", "parm", "--saver", "hf", "--load-dir", tmp_path / "ckpt",
                     "--save-dir", tmp_path / "hf")
    assert result.returncode == 0, result.stderr[-3000:]
    trained, info = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                          output_loading_info=True)
    assert not any(info.values()), info

    sp = sentencepiece.SentencePieceProcessor(model_file=gpt_data["tokenizer"])
    prompt_ids = sp.encode(PROMPT)
    sequences = _sequences(gpt_data, count=2, length=32)
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({"tokens": sequences, "prompt": prompt_ids,
                                  "eod": sp.eos_id(), "vocab": sp.vocab_size()}))
    status, output = torchrun(["--nproc-per-node", 4, "--master-port", free_port(),
                               "tests/worker_layout_logits.py", inputs, tmp_path / "out.pt",
                               tmp / "imported", tmp_path / "ckpt", *LAYOUT])
    assert status == 0, output[-4000:]
    (imported_logits, imported_ids), (trained_logits, _) = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        for ours, reference in ((imported_logits, model), (trained_logits, trained)):
            theirs = reference(torch.tensor(sequences)).logits
            assert (ours[..., :sp.vocab_size()] - theirs).abs().max() <= 1e-4
        continued = model.generate(torch.tensor([prompt_ids]), max_new_tokens=20,
                                   do_sample=False)[0, len(prompt_ids):].tolist()
    assert imported_ids == continued
    assert generate(1, tmp / "imported") == (prompt_ids, continued)


@pytest.mark.parametrize("changes, needle", [
    (dict(qk_layernorm=False), "without --qk-layernorm"),
    (dict(moe_router_score_function="softmax"), "--moe-router-score-function softmax"),
    (dict(norm_epsilon=1e-5), "--norm-epsilon 1e-05"),
    (dict(moe_layer_freq=[1, 0]), "dense layers first"),
    (dict(moe_shared_expert_intermediate_size=48), "--moe-shared-expert-intermediate-size 48"),
])
def test_export_refusals(changes, needle):
    """What the export checks from run.json's args before any tensor is read."""
    from parm_trainer.arguments import parse_args
    from parm_trainer.convert.decoder import NotExportable
    from parm_trainer.convert.deepseek_v3 import hf_config

    words = tiny_gpt_args({"prefix": "-", "tokenizer": "-"}, **MLA_FLAGS)
    args = vars(parse_args(words + ["--tensor-model-parallel-size", "1", "--expert-model-"
                                    "parallel-size", "1"], world_size=1))
    hf_config(args, 2000, 1, 2)  # the trained model's flags export
    with pytest.raises(NotExportable, match=needle.replace("[", r"\[")):
        hf_config({**args, **changes}, 2000, 1, 2)


def test_what_models_mla_answers_still_holds():
    """megatron-core's local DotProductAttention still refuses MLA's k_channels/v_channels, and
    without Transformer Engine multi_latent_attention.py's TELinear is no class (models/mla.py
    answers both; this fails once either is no longer so)."""
    import inspect

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer import multi_latent_attention

    from parm_trainer.models.backend import installed

    assert "v_channels" not in inspect.signature(DotProductAttention.__init__).parameters
    if not installed("transformer_engine"):
        assert not isinstance(multi_latent_attention.TELinear, type)
