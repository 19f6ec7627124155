"""GPT with MoE layers on megatron-core's GPTModel, built from layer specs."""

from __future__ import annotations

import argparse
import logging
from typing import Optional

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from parm_trainer.models.mla import use_local_latent_attention
from parm_trainer.models.qk_norm import AcrossHeadsRMSNorm
from parm_trainer.moe.layer import ParmMoELayer


# TransformerLayer passes process groups only to the MLP classes it knows and logs "Unknown MLP
# type" for any other; ParmMoELayer takes its groups from parallel_state, so the note is noise.
logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(
    lambda record: "Unknown MLP type" not in record.getMessage())


def uses_te(args: argparse.Namespace) -> bool:
    return getattr(args, "transformer_impl", "local") == "transformer_engine"


def moe_module_spec(args: argparse.Namespace) -> ModuleSpec:
    """megatron's MoE layer spec for --transformer-impl and --moe-grouped-gemm: its experts
    are SequentialMLP, GroupedMLP or (Transformer Engine) TEGroupedMLP."""
    return get_moe_module_spec(use_te=uses_te(args), num_experts=args.num_experts,
                               moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False))


def gpt_layer_spec(config: TransformerConfig, args: argparse.Namespace,
                   vp_stage: Optional[int] = None):
    """The layer spec (or block spec, with MoE) of the model; see _megatron_spec. Multi-latent
    attention on the local spec gets models/mla.py's core attention; --qk-layernorm-across-heads
    its norms over all heads."""
    spec = _megatron_spec(config, args, vp_stage)
    # a block spec may hold no layer (a pipeline stage of the embedding alone)
    for layer in spec.layer_specs if hasattr(spec, "layer_specs") else [spec]:
        use_local_latent_attention(layer)
        norms_across_heads(layer, args)
    return spec


def _megatron_spec(config: TransformerConfig, args: argparse.Namespace,
                   vp_stage: Optional[int] = None):
    """megatron's local spec, or Transformer Engine's with --transformer-impl
    transformer_engine; MoE layers where --moe-layer-freq puts them (experts grouped with
    --moe-grouped-gemm, from config.moe_grouped_gemm), run through Parm's schedule unless
    --moe-parm-schedule megatron. With MoE, the block spec of this pipeline rank's model
    chunk vp_stage (megatron slices the layers per stage)."""
    if not config.num_moe_experts:
        if uses_te(args):
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec)

            return get_gpt_layer_with_transformer_engine_spec(
                qk_layernorm=config.qk_layernorm,
                multi_latent_attention=config.multi_latent_attention)
        return get_gpt_layer_local_spec(normalization=args.normalization,
                                        qk_layernorm=config.qk_layernorm,
                                        multi_latent_attention=config.multi_latent_attention)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=uses_te(args),
                                       normalization=args.normalization, vp_stage=vp_stage)
    for layer in block.layer_specs:
        parm_moe_unless_megatron(layer, args)
    return block


def parm_moe_unless_megatron(layer_spec: ModuleSpec, args: argparse.Namespace) -> None:
    """Parm's MoE layer in a layer spec unless --moe-parm-schedule megatron."""
    if args.moe_parm_schedule != "megatron":
        use_parm_moe_layer(layer_spec, args.moe_parm_schedule, args.moe_parm_chunks,
                           args.moe_parm_exchange, args.moe_parm_local_first,
                           args.moe_shared_expert_overlap)


def norms_across_heads(layer_spec: ModuleSpec, args: argparse.Namespace) -> ModuleSpec:
    """With --qk-layernorm-across-heads, the query and key norms of a layer spec normalise
    over all heads (qk_norm.py); the spec as it was otherwise."""
    if getattr(args, "qk_layernorm_across_heads", False):
        attention = layer_spec.submodules.self_attention.submodules
        attention.q_layernorm = ModuleSpec(module=AcrossHeadsRMSNorm, params={"part": "query"})
        attention.k_layernorm = ModuleSpec(module=AcrossHeadsRMSNorm, params={"part": "key"})
    return layer_spec


def use_parm_moe_layer(layer_spec: ModuleSpec, schedule: str, chunks: int,
                       exchange: str = "exact", local_first: bool = False,
                       shared_overlap: bool = False) -> None:
    """Swap megatron's MoELayer for ParmMoELayer in a layer spec, keeping router and experts."""
    mlp = layer_spec.submodules.mlp
    if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
        layer_spec.submodules.mlp = ModuleSpec(
            module=ParmMoELayer, submodules=mlp.submodules,
            params={**(mlp.params or {}), "schedule": schedule, "chunks": chunks,
                    "exchange": exchange, "local_first": local_first,
                    "shared_overlap": shared_overlap})


def language_model_kwargs(args: argparse.Namespace, config: TransformerConfig,
                          vocab_size: int, pre_process: bool, post_process: bool,
                          vp_stage: Optional[int] = None) -> dict:
    """The constructor arguments megatron's GPTModel and BertModel share."""
    return dict(
        vp_stage=vp_stage,
        config=config,
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )


def build_gpt_moe(args: argparse.Namespace, config: TransformerConfig, vocab_size: int,
                  pre_process: bool = True, post_process: bool = True,
                  vp_stage: Optional[int] = None) -> GPTModel:
    """This pipeline rank's GPT (its model chunk vp_stage under interleaved 1F1B)."""
    return GPTModel(transformer_layer_spec=gpt_layer_spec(config, args, vp_stage),
                    rotary_base=args.rotary_base,
                    mtp_block_spec=mtp_block_spec(config, args, vp_stage),
                    **language_model_kwargs(args, config, vocab_size, pre_process, post_process,
                                            vp_stage))


def mtp_block_spec(config: TransformerConfig, args: argparse.Namespace,
                   vp_stage: Optional[int] = None):
    """megatron's MTP block spec for --mtp-num-layers on the stage that holds the MTP layers
    (None elsewhere and without MTP), as Megatron-LM's gpt_builders: each MTP layer's
    transformer layer is the model's last decoder layer's spec, with this stack's changes
    (Parm's MoE layer, the local MLA core attention, norms across heads). Where a last stage
    holds no decoder layer Megatron-LM takes a dense layer instead; here still the last layer."""
    if not config.mtp_num_layers:
        return None
    if config.num_moe_experts:
        layer = get_gpt_decoder_layer_specs(config, uses_te(args), args.normalization)[-1]
        use_local_latent_attention(layer)
        norms_across_heads(layer, args)
        parm_moe_unless_megatron(layer, args)
    else:
        layer = gpt_layer_spec(config, args)
    return get_gpt_mtp_block_spec(config, layer, use_transformer_engine=uses_te(args),
                                  vp_stage=vp_stage)


def _module_name(spec) -> str:
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    return getattr(module, "__name__", str(module))


def describe_modules(args: argparse.Namespace, config: TransformerConfig) -> str:
    """The start-up line naming the modules megatron builds: the attention's QKV projection,
    the norm before it, the experts; and whether Transformer Engine and apex are installed
    (megatron's local spec takes apex's fused LayerNorm where it is)."""
    from parm_trainer.models.backend import library_report

    # every layer of the model (a pipeline stage may hold none), as gpt_layer_spec builds them
    # before it picks this stage's and swaps in Parm's MoE layer (which keeps the experts)
    if config.num_moe_experts:
        layers = get_gpt_decoder_layer_specs(config, uses_te(args), args.normalization)
    else:
        layers = [gpt_layer_spec(config, args)]
    first = layers[0].submodules
    norm = _module_name(first.input_layernorm)
    attention = first.self_attention.submodules
    projection = getattr(attention, "linear_qkv", None) or attention.linear_kv_down_proj
    parts = [f"{'qkv' if hasattr(attention, 'linear_qkv') else 'multi-latent kv down'} "
             f"{_module_name(projection)}",
             "norm fused into qkv" if norm == "IdentityOp" else f"norm {norm}"]
    experts = {_module_name(layer.submodules.mlp.submodules.experts) for layer in layers
               if hasattr(layer.submodules.mlp.submodules, "experts")}
    if experts:
        parts.append(f"experts {', '.join(sorted(experts))}")
    return (f"modules (--transformer-impl {getattr(args, 'transformer_impl', 'local')}): "
            f"{', '.join(parts)}; {library_report()}")


def logits_with_mtp(model, tokens, positions) -> list:
    """[the model's logits, MTP layer 1's, ...], each [batch, sequence, vocabulary (this TP
    rank's part)], of a last pipeline stage that holds the MTP layers: megatron-core 0.16.1's
    GPTModel computes its output there only with labels (its MTP losses), so it is given dummy
    ones and the output layer's outputs are kept as they come (the MTP layers' first; copies, as
    megatron's cross entropy turns logits into probabilities in place)."""
    import torch

    seen = []
    hook = model.output_layer.register_forward_hook(
        lambda module, args, out: seen.append(out[0].transpose(0, 1).clone()))
    try:
        model(tokens, positions, None, labels=torch.zeros_like(tokens))
    finally:
        hook.remove()
    return [seen[-1], *seen[:-1]]
