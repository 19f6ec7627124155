"""Multi-latent attention on megatron-core's local spec (--multi-latent-attention).

megatron-core 0.16.1's MLASelfAttention builds its core attention with the heads' key and value
sizes (k_channels: --qk-head-dim + --qk-pos-emb-head-dim, v_channels: --v-head-dim), which
Transformer Engine's attention takes and the local DotProductAttention does not: its
constructor refuses them, and its output is laid out as heads x --kv-channels. The local spec
gets the subclass below instead, the same computation with the output laid out as heads x
v_channels (the softmax scale is MLA's own, with YaRN's mscale, given by MLASelfAttention).

Without Transformer Engine, megatron-core 0.16.1's multi_latent_attention.py still sets
HAVE_TE = True: its `from megatron.core.extensions.transformer_engine import TELinear, ...`
succeeds, TELinear being built on a MagicMock there, and `isinstance(self.linear_proj,
TELinear)` (MultiLatentAttention.__init__) then raises. te_flag_is_wrong() says whether that
holds; the local spec sets the flag to what it means (Transformer Engine is not there).
"""

from __future__ import annotations

from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec


class LatentDotProductAttention(DotProductAttention):
    """DotProductAttention whose heads have k_channels for the scores and v_channels out."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def te_flag_is_wrong() -> bool:
    """Whether multi_latent_attention.py believes in a Transformer Engine that is not there."""
    return multi_latent_attention.HAVE_TE and not isinstance(multi_latent_attention.TELinear,
                                                              type)


def use_local_latent_attention(layer_spec: ModuleSpec) -> None:
    """In a layer spec of MLASelfAttention with the local core attention, the subclass."""
    attention = getattr(layer_spec.submodules, "self_attention", None)
    if (isinstance(attention, ModuleSpec) and attention.module is MLASelfAttention
            and attention.submodules.core_attention is DotProductAttention):
        attention.submodules.core_attention = LatentDotProductAttention
        if te_flag_is_wrong():
            multi_latent_attention.HAVE_TE = False
