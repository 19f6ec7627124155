"""--qk-layernorm-across-heads: an RMSNorm of the whole query (or key) projection, all heads.

megatron-core's --qk-layernorm normalises each head on its own (a weight of one head's width,
shared by the heads). Here the mean of squares runs over every head of the projection and the
weight has a value per channel of every head (OLMoE's q_norm and k_norm), so under tensor
parallelism, where each rank holds some of the heads, the sums of squares are added over the
TP group (an all-reduce whose backward is an all-reduce too) and the weight is split with the
heads: a tensor-parallel parameter (dim 0), saved and loaded in its global shape.

Megatron's attention builds it in the place of its per-head norm, with the input
[s, b, heads on this rank, channels]; the layer spec names it (models/gpt.py). The model's
TransformerConfig keeps qk_layernorm False, as megatron's finalize_model_grads would
otherwise sum this split weight's gradients over the TP group as if it were replicated.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint


class AcrossHeadsRMSNorm(torch.nn.Module):
    """RMSNorm over all heads of the query ("query") or key ("key") projection."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, part: str = "query"):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        heads = config.num_attention_heads if part == "query" else (
            config.num_query_groups or config.num_attention_heads)
        self.channels, self.eps, self.width = hidden_size, eps, heads * hidden_size
        self.local_heads = heads // tp
        self.weight = torch.nn.Parameter(torch.ones(self.local_heads * hidden_size,
                                                    dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.float().pow(2).sum(dim=(-2, -1), keepdim=True)
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            import torch.distributed.nn.functional as dist_nn

            squares = dist_nn.all_reduce(squares,
                                         group=parallel_state.get_tensor_model_parallel_group())
        normed = x.float() * torch.rsqrt(squares / self.width + self.eps)
        return self.weight.view(self.local_heads, self.channels) * normed.to(x.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True),
                                                   prefix, {"weight": 0}, sharded_offsets)
