"""Which Hugging Face decoder class a model is written as, and which one a directory holds.

Export picks the class from run.json's flags: DeepseekV3ForCausalLM for
--multi-latent-attention, OlmoeForCausalLM for --qk-layernorm-across-heads, Qwen3MoeForCausalLM
for --qk-layernorm, MixtralForCausalLM where it expresses the model exactly, else
Qwen2MoeForCausalLM; a model the chosen class cannot express is refused with the reason (the
family's problem(), before anything is written). Import goes by config.json's model_type.
"""

from __future__ import annotations

from parm_trainer.convert import deepseek_v3, mixtral, olmoe, qwen2_moe, qwen3_moe
from parm_trainer.convert.decoder import NotExportable

TARGETS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe,
           "olmoe": olmoe, "deepseek_v3": deepseek_v3}  # config.json's model_type -> module


def target_of(args: dict):
    """The family module whose class expresses run.json's model, or NotExportable."""
    if args.get("multi_latent_attention"):
        family = deepseek_v3
    elif args.get("qk_layernorm_across_heads"):
        family = olmoe
    elif args.get("qk_layernorm"):
        family = qwen3_moe
    elif mixtral.expresses(args):
        return mixtral
    else:
        family = qwen2_moe
    why = family.problem(args)
    if why is not None:
        raise NotExportable(why)
    return family
