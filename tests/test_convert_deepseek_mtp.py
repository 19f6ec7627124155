"""DeepSeek-V3's multi-token prediction layers through tools/checkpoint/convert.py.

A random DeepseekV3ForCausalLM made by transformers (which builds no MTP layer), its files given
one MTP layer as DeepSeek publishes it (layer num_hidden_layers: a decoder layer's tensors,
enorm, hnorm, eh_proj, shared_head.norm, and embed_tokens and shared_head.head, copies of the
model's; num_nextn_predict_layers 1 in config.json), imports with --mtp-num-layers 1 and exports
back bit for bit, the MTP tensors and the count included. The project's MTP logits are an
independent computation's from the Hugging Face tensors: shared_head.head(shared_head.norm(
layer(eh_proj(cat(enorm(embed(ids shifted by one)), hnorm(h)))))), the layer transformers' own
DeepseekV3DecoderLayer with the MTP layer's tensors and h the model's last hidden states (after
its final norm, as megatron-core's MTP takes them); tools/generate.py continues a prompt as
transformers does. Copies that differ from the model's tensor are refused in one line, nothing
written.
"""

import json
import shutil

import sentencepiece
import torch
from safetensors.torch import load_file, save_file

from test_convert import PROMPT, _sequences, convert, generate, project_logits
from test_convert_deepseek import SHARD, _deepseek, _import
from test_convert_stream import _assert_same_weights, _weights

from parm_trainer.convert.hf_files import INDEX

LAYERS = 3  # the decoder's; the MTP layer is Hugging Face's layer 3


def _with_mtp(directory, tokenizer, tmp):
    """The files of a random DeepSeek-V3 with one MTP layer added (a shard of its own, as
    DeepSeek's last), and the MTP layer's tensors by their names under the layer."""
    model = _deepseek(directory, tokenizer, num_hidden_layers=LAYERS)
    # a model one layer deeper gives a decoder layer's tensors as transformers writes them
    _deepseek(tmp / "deeper", tokenizer, num_hidden_layers=LAYERS + 1, first_k_dense_replace=1)
    prefix = f"model.layers.{LAYERS}."
    mtp = {name: tensor for name, tensor in _weights(tmp / "deeper").items()
           if name.startswith(prefix)}
    h = model.config.hidden_size
    generator = torch.Generator().manual_seed(7)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{prefix}{name}.weight"] = torch.rand(h, generator=generator) + 0.5
    mtp[f"{prefix}eh_proj.weight"] = torch.randn(h, 2 * h, generator=generator) / (2 * h) ** 0.5
    mtp[f"{prefix}embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    mtp[f"{prefix}shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    save_file(mtp, str(directory / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.load(open(directory / INDEX))
    index["weight_map"].update({name: "model-mtp.safetensors" for name in mtp})
    (directory / INDEX).write_text(json.dumps(index))
    config = json.load(open(directory / "config.json"))
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return model, {name[len(prefix):]: tensor for name, tensor in mtp.items()}


def _mtp_logits(model, tensors, sequences):
    """The MTP layer's logits at positions 0 .. s-2 (predicting the token two ahead), computed
    from the Hugging Face tensors alone."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer,
                                                                      DeepseekV3RMSNorm)

    config = model.config
    layer = DeepseekV3DecoderLayer(config, LAYERS).eval()
    own = {name: t for name, t in tensors.items() if not name.startswith(
        ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))}
    layer.load_state_dict(_fused(own, config))

    def norm(name, x):
        module = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        module.weight.data.copy_(tensors[f"{name}.weight"])
        return module(x)

    ids = torch.tensor(sequences)
    with torch.no_grad():
        h = model.model(ids).last_hidden_state[:, :-1]
        e = torch.nn.functional.embedding(ids[:, 1:], tensors["embed_tokens.weight"])
        x = torch.cat([norm("enorm", e), norm("hnorm", h)], -1) @ tensors["eh_proj.weight"].t()
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        mask = torch.full((x.shape[1],) * 2, float("-inf")).triu(1)[None, None]
        x = layer(x, attention_mask=mask, position_ids=positions,
                  position_embeddings=model.model.rotary_emb(x, positions))
        x = x[0] if isinstance(x, tuple) else x
        return norm("shared_head.norm", x) @ tensors["shared_head.head.weight"].t()


def _fused(tensors: dict, config) -> dict:
    """A decoder layer's tensors as the file holds them (one per expert) in transformers'
    module form (its experts' stacked gate_up_proj and down_proj)."""
    experts = range(config.n_routed_experts)
    out = {name: t for name, t in tensors.items() if ".experts." not in name}
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        [tensors[f"mlp.experts.{e}.gate_proj.weight"], tensors[f"mlp.experts.{e}.up_proj.weight"]])
        for e in experts])
    out["mlp.experts.down_proj"] = torch.stack([tensors[f"mlp.experts.{e}.down_proj.weight"]
                                                for e in experts])
    return out


def test_mtp_layers_import_export_and_compute_as_deepseeks(gpt_data, tmp_path):
    original = tmp_path / "original"
    model, tensors = _with_mtp(original, gpt_data["tokenizer"], tmp_path)
    printed = _import(original, tmp_path / "imported")
    assert "--mtp-num-layers 1" in printed, printed
    back = convert("--loader", "parm", "--saver", "hf", "--load-dir", tmp_path / "imported",
                   "--save-dir", tmp_path / "back", "--max-shard-size", SHARD)
    assert back.returncode == 0, back.stderr[-3000:]
    _assert_same_weights(original, tmp_path / "back")  # the MTP tensors among them
    assert json.load(open(tmp_path / "back" / "config.json"))["num_nextn_predict_layers"] == 1

    sp = sentencepiece.SentencePieceProcessor(model_file=gpt_data["tokenizer"])
    sequences = _sequences(gpt_data, count=2)
    logits = project_logits(tmp_path / "imported", sequences, tmp_path / "logits.pt")
    assert logits.shape[0] == 2  # the model's, then the MTP layer's
    vocab = sp.vocab_size()
    with torch.no_grad():
        theirs = model(torch.tensor(sequences)).logits
    assert (logits[0, ..., :vocab] - theirs).abs().max() <= 1e-4
    mtp = _mtp_logits(model, tensors, sequences)
    assert (logits[1, :, :-1, :vocab] - mtp).abs().max() <= 1e-4
    assert (mtp - theirs[:, 1:]).abs().max() > 1e-2  # another function than the model's
    # tools/generate.py with the MTP layers (their output unused): transformers' continuation
    prompt_ids = sp.encode(PROMPT)
    with torch.no_grad():
        continued = model.generate(torch.tensor([prompt_ids]), max_new_tokens=20,
                                   do_sample=False)[0, len(prompt_ids):].tolist()
    assert generate(1, tmp_path / "imported") == (prompt_ids, continued)

    # an MTP layer whose embedding is not the model's: refused, nothing written
    changed = tmp_path / "changed"
    shutil.copytree(original, changed)
    name = f"model.layers.{LAYERS}.embed_tokens.weight"
    mtp_file = load_file(str(original / "model-mtp.safetensors"))
    mtp_file[name][5, 0] += 1.0
    save_file(mtp_file, str(changed / "model-mtp.safetensors"), metadata={"format": "pt"})
    result = convert("--loader", "hf", "--saver", "parm", "--load-dir", changed,
                     "--save-dir", tmp_path / "out")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert f"{name} differs from model.embed_tokens.weight" in errors[0], errors
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
