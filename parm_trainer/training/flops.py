"""Model FLOPs per iteration, counting only the parameters a token activates.

Per token and layer, forward:  2 * h * d * (2 n + 2 g_kv)        attention projections (q,o: n heads
                                                                of d channels; k,v: g_kv groups)
                             + 4 * s * n * d                    scores QK^T and weighted sum of V
                             + 2 * h * E                        router (MoE layers)
                             + 2 * k * g * h * H                k active experts (g = 3 with SwiGLU,
                                                                2 otherwise); dense MLP: k=1, H=F
                             + 2 * g * h * S (+ 2 * h)          the shared expert of width S (and
                                                                its gate), where there is one
plus 2 * h * V per token for the logits. Each MTP layer (--mtp-num-layers) is one more layer
of the last decoder layer's kind, plus its projection 2 * 2h * h and its own logits 2 * h * V
(as Megatron-LM's num_floating_point_operations; its norms are not counted here). With --multi-latent-attention the projections are its
weights and the scores and values its head sizes (mla_flags.attention_sizes). Training = 3 x forward (backward ~ 2 x forward).
Causal masking is not discounted, matching Megatron-LM's reporting.
"""

from __future__ import annotations

from parm_trainer.mla_flags import attention_sizes
from parm_trainer import mtp_flags
from parm_trainer.models.config import pattern_with_mtp


def flops_per_iteration(args, vocab_size: int | None = None,
                        batch_size: int | None = None) -> float:
    """FLOPs of an iteration of batch_size samples (default --global-batch-size; the training
    loop asks for one sample's and scales by the samples of a ramp-up's iterations)."""
    h, s = args.hidden_size, args.seq_length
    pattern = pattern_with_mtp(args)  # the decoder's layers and the MTP layers
    L, mtp = len(pattern), mtp_flags.num_layers(args)
    vocab = vocab_size or getattr(args, "padded_vocab_size", 0) or 0
    gated = 3 if args.swiglu else 2
    sizes = attention_sizes(args)  # multi-latent attention: its projections and head sizes
    per_layer_common = 2 * sizes["split"] + 2 * s * (sizes["score"] + sizes["value"])
    dense_mlp = 2 * gated * h * args.ffn_hidden_size
    moe_layers = sum(pattern)
    moe_mlp = 2 * h * (args.num_experts or 0) + 2 * args.moe_router_topk * gated * h * (
        args.moe_ffn_hidden_size or 0)
    shared = getattr(args, "moe_shared_expert_intermediate_size", None)
    if shared and args.num_experts:
        moe_mlp += 2 * gated * h * shared + (2 * h if args.moe_shared_expert_gate else 0)
    forward_per_token = (L * per_layer_common + moe_layers * moe_mlp
                         + (L - moe_layers) * dense_mlp + (1 + mtp) * 2 * h * vocab
                         + mtp * 2 * 2 * h * h)
    tokens = (batch_size or args.global_batch_size) * s
    return 3.0 * forward_per_token * tokens
