"""Pretrain a Mixture-of-Experts GPT on megatron-core.

    torchrun --nproc-per-node 4 pretrain_gpt_moe.py \
        --tensor-model-parallel-size 2 --expert-model-parallel-size 2 \
        --expert-tensor-parallel-size 2 --sequence-parallel --disable-bias-linear \
        --num-experts 4 --moe-router-topk 2 --num-layers 4 --hidden-size 256 \
        --num-attention-heads 8 --seq-length 256 --micro-batch-size 4 --global-batch-size 16 \
        --train-iters 300 --lr 1e-3 --data-path data/demo/corpus_text_document \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/demo/tokenizer.model

The tokenizer flags are Megatron-LM's: `--vocab-file gpt2-vocab.json --merge-file
gpt2-merges.txt` (GPT-2 BPE, as its GPT-3 recipe gives them), `--tokenizer-type Llama2Tokenizer
--tokenizer-model ...`, `--tokenizer-type NullTokenizer --vocab-size N`.

This file holds only the GPT-specific providers (model, datasets, forward step and loss);
parm_trainer.training runs the loop. `scripts/` has launchers for one node, many nodes and slurm.
"""

import sys

from parm_trainer.process_exit import end
from parm_trainer.lazy_imports import eager_fusions_without_cuda, skip_wandb_unless_asked
from parm_trainer.training.user_errors import check_flags_first

skip_wandb_unless_asked(sys.argv)  # before megatron-core is imported (lazy_imports.py)
if __name__ == "__main__":  # bad flags end the job before torch is imported
    check_flags_first(sys.argv[1:])
eager_fusions_without_cuda()

from functools import partial

import torch

from parm_trainer.data.gpt_datasets import build_gpt_datasets
from parm_trainer.models.gpt import build_gpt_moe
from parm_trainer.training.data import batch_to_device
from parm_trainer.training.initialize import initialize
from parm_trainer.training.loop import pretrain
from parm_trainer.training.user_errors import user_errors


def model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    return build_gpt_moe(args, config, args.padded_vocab_size, pre_process, post_process, vp_stage)


def datasets_provider(args, num_samples):
    return build_gpt_datasets(args.data_path, args.split, args.seq_length, args.seed,
                              args.tokenizer, num_samples, args.data_cache_path, args.mock_data)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token cross entropy summed over unmasked tokens; megatron divides by the count."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, position_ids = batch_to_device(
        next(data_iterator), "tokens", "labels", "loss_mask", "position_ids")
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(loss_func, loss_mask)


def main(argv=None):
    with user_errors():
        args = initialize(argv)
        pretrain(args, model_provider, datasets_provider, forward_step)


if __name__ == "__main__":
    end(main())
