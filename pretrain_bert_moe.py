"""Pretrain a Mixture-of-Experts BERT (masked LM + sentence order) on megatron-core.

    torchrun --nproc-per-node 4 pretrain_bert_moe.py \
        --tensor-model-parallel-size 2 --expert-model-parallel-size 2 \
        --expert-tensor-parallel-size 2 --sequence-parallel --disable-bias-linear \
        --num-experts 4 --moe-router-topk 2 --moe-parm-schedule auto --num-layers 4 \
        --hidden-size 128 --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 \
        --global-batch-size 16 --train-iters 300 --lr 1e-3 \
        --data-path data/demo/corpus_text_sentence \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/demo/tokenizer.model

The data is sentence-level: `tools/preprocess_data.py --split-sentences`. This file holds only
the BERT-specific flags and providers (model, datasets, forward step and loss);
parm_trainer.training runs the loop, exactly as for GPT.
"""

import sys

from parm_trainer.process_exit import end
from parm_trainer.arguments import add_bert_args
from parm_trainer.lazy_imports import eager_fusions_without_cuda, skip_wandb_unless_asked
from parm_trainer.training.user_errors import check_flags_first

skip_wandb_unless_asked(sys.argv)  # before megatron-core is imported (lazy_imports.py)
if __name__ == "__main__":  # bad flags end the job before torch is imported
    check_flags_first(sys.argv[1:], add_bert_args)
eager_fusions_without_cuda()

from functools import partial

import torch
import torch.nn.functional as F

from parm_trainer.data.bert_datasets import (build_bert_datasets, check_bert_tokenizer,
                                             check_sentence_level)
from parm_trainer.data.gpt_datasets import parse_data_path
from parm_trainer.models.bert import build_bert_moe
from parm_trainer.training.data import batch_to_device
from parm_trainer.errors import InputError
from parm_trainer.training.initialize import initialize
from parm_trainer.training.loop import pretrain
from parm_trainer.training.user_errors import user_errors


def check_bert_inputs(args):
    """Before any communication: the tokenizer's special tokens, sentence-level data (the
    flags' ranges: parse_args's)."""
    if args.mtp_num_layers:  # megatron-core's BertModel has no MTP block
        raise InputError(f"--mtp-num-layers {args.mtp_num_layers} is for GPT: BERT predicts "
                         f"masked tokens, not the next ones (leave the flag out)")
    if args.mock_data:  # megatron-core has a mock GPT dataset only
        raise InputError("--mock-data is for GPT (megatron-core has no mock BERT dataset); "
                         "give --data-path")
    check_bert_tokenizer(args.tokenizer)
    for prefix in parse_data_path(args.data_path)[0]:
        check_sentence_level(prefix)


def model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    return build_bert_moe(args, config, args.padded_vocab_size, pre_process, post_process, vp_stage)


def datasets_provider(args, num_samples):
    return build_bert_datasets(args.data_path, args.split, args.seq_length, args.seed,
                               args.tokenizer, num_samples, args.bert_binary_head, args.mask_prob,
                               args.short_seq_prob, args.data_cache_path)


def loss_func(loss_mask, sentence_order, output_tensor):
    """Mean masked-LM cross entropy over the masked tokens, plus the mean sentence-order cross
    entropy (Megatron-LM's BERT loss); megatron averages it over micro-batches. Each report is
    a (sum, count) pair, summed over micro-batches and data-parallel ranks by the loop."""
    lm_losses, sop_logits = output_tensor
    mask = loss_mask.float().view(-1)
    lm_sum = torch.sum(lm_losses.float().view(-1) * mask)
    loss = lm_sum / mask.sum().clamp(min=1)
    reports = {"lm loss": torch.stack([lm_sum.detach(), mask.sum()])}
    if sop_logits is not None:
        sop_logits, sentence_order = sop_logits.float().view(-1, 2), sentence_order.view(-1)
        sop_sum = F.cross_entropy(sop_logits, sentence_order, reduction="sum")
        samples = sop_sum.new_tensor(float(sentence_order.numel()))
        loss = loss + sop_sum / samples
        correct = (sop_logits.argmax(dim=-1) == sentence_order).sum().float()
        reports["sop loss"] = torch.stack([sop_sum.detach(), samples])
        reports["sop accuracy"] = torch.stack([correct, samples])
    return loss, reports


def forward_step(data_iterator, model, binary_head=True):
    tokens, types, labels, loss_mask, padding_mask, sentence_order = batch_to_device(
        next(data_iterator), "text", "types", "labels", "loss_mask", "padding_mask", "is_random")
    # megatron's sample marks real tokens 1 and padding with the pad id (0 for our tokenizers)
    attention_mask = (padding_mask == 1).long()
    output = model(tokens, attention_mask, tokentype_ids=types if binary_head else None,
                   lm_labels=labels)
    return output, partial(loss_func, loss_mask, sentence_order)


def main(argv=None):
    with user_errors():
        args = initialize(argv, add_bert_args, check_bert_inputs)
        args.model_family = "bert"  # what its checkpoints' run.json says
        losses = ("lm loss", "sop loss", "sop accuracy") if args.bert_binary_head else ("lm loss",)
        pretrain(args, model_provider, datasets_provider,
                 partial(forward_step, binary_head=args.bert_binary_head), losses)


if __name__ == "__main__":
    end(main())
