"""Multi-token prediction (--mtp-num-layers) in one process: parm_trainer's GPT with MTP against
megatron-core's own GPTModel built from the same config, megatron's own specs and the same
weights (loss, the MTP part included, the MTP losses megatron tracks, every gradient)."""

import warnings

import pytest
import torch

from parm_trainer.arguments import parse_args
from parm_trainer.planning.checks import validate_layout

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron.core: optional GPU extensions missing
    from parm_trainer.models.config import transformer_config

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-experts", "4", "--moe-ffn-hidden-size", "48", "--seq-length", "16",
        "--disable-bias-linear", "--moe-parm-chunks", "1", "--position-embedding-type", "rope",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--normalization", "RMSNorm",
        "--swiglu", "--moe-layer-freq", "[0,1]"]
VOCAB = 256


def tiny_args(*extra):
    args = parse_args([*TINY, *extra], world_size=1)
    validate_layout(args)
    return args


def megatron_reference(config, args):
    """megatron-core's GPTModel as Megatron-LM's gpt_builders makes it: its decoder block spec
    and the MTP block of its last decoder layer's spec, megatron's own MoELayer."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec, get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec)

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                       normalization=args.normalization)
    last = get_gpt_decoder_layer_specs(config, False, args.normalization)[-1]
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=VOCAB,
                    max_sequence_length=args.seq_length, position_embedding_type="rope",
                    share_embeddings_and_output_weights=True, parallel_output=True,
                    mtp_block_spec=get_gpt_mtp_block_spec(config, last, False))


def loss_and_grads(model, tokens, labels, loss_mask):
    """The loss megatron's schedule backpropagates (one micro-batch: the mean over the
    unmasked tokens; GPTModel adds the MTP loss to the gradient), the MTP losses it tracked,
    and every parameter's gradient."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    moe_utils.get_moe_layer_wise_logging_tracker().clear()  # sized by the MoE and MTP layers
    model.zero_grad()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    per_token = model(tokens, positions, None, labels=labels, loss_mask=loss_mask)
    loss = (per_token * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    tracked = MTPLossLoggingHelper.tracker["values"].clone()
    return loss.detach(), tracked, {name: p.grad.clone() for name, p in model.named_parameters()
                                    if p.grad is not None}


@pytest.mark.parametrize("mtp,schedule", [(1, "s1"), (2, "s2"), (2, "baseline")])
def test_mtp_model_matches_megatron(one_rank_world, mtp, schedule):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from parm_trainer.models.gpt import build_gpt_moe
    from parm_trainer.models.init import init_weights_layout_free

    args = tiny_args("--mtp-num-layers", str(mtp), "--moe-parm-schedule", schedule)
    config = transformer_config(args)
    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3)
    ours = build_gpt_moe(args, config, VOCAB)
    init_weights_layout_free(ours, 5, 0.02, args.num_layers)
    reference = megatron_reference(config, args)
    assert len(ours.mtp.layers) == mtp
    assert type(ours.mtp.layers[0].transformer_layer.mlp).__name__ == "ParmMoELayer"
    assert type(reference.mtp.layers[0].transformer_layer.mlp).__name__ == "MoELayer"
    missing = reference.load_state_dict(ours.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, args.seq_length), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    loss_mask = torch.ones(tokens.shape)
    loss_mask[0, 3] = 0.0
    ours.train(), reference.train()
    loss, tracked, grads = loss_and_grads(ours, tokens, labels, loss_mask)
    ref_loss, ref_tracked, ref_grads = loss_and_grads(reference, tokens, labels, loss_mask)
    assert tracked.shape == (mtp,) and torch.all(tracked > 0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tracked, ref_tracked, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    assert any(name.startswith("mtp.") for name in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")
