"""Every flag, with Megatron-LM's name, meaning and default, in argparse groups (model, mixture
of experts, parallelism, training, data, evaluation/checkpoints/logging; BERT's on request),
and the parser that holds them."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

from parm_trainer import error_line, mla_flags, moe_flags, mtp_flags
from parm_trainer.arguments.megatron_only import add_flags as add_megatron_only_flags
from parm_trainer.arguments.recompute import add_flags as add_recompute_flags
from parm_trainer.layer_pattern import moe_layer_freq

# signals --exit-signal-handler can catch (Megatron-LM takes any name of signal.Signals)
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")


def _model_group(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2, help="Transformer layers.")
    g.add_argument("--hidden-size", type=int, default=128, help="Hidden (model) size M.")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="Dense MLP hidden size (default 4 x hidden size).")
    g.add_argument("--num-attention-heads", type=int, default=4, help="Attention heads.")
    g.add_argument("--group-query-attention", action="store_true",
                   help="Grouped-query attention: --num-query-groups key/value heads.")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="Key/value heads with --group-query-attention.")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Channels per attention head (default hidden size / heads).")
    g.add_argument("--seq-length", type=int, default=128, help="Tokens per sample.")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Learned position table size (default: --seq-length).")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute", help="Position encoding.")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base (theta).")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="No learned position table (Megatron-LM's deprecated flag): valid only "
                        "with --position-embedding-type rope, which has none.")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                   help="Norm layer type.")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the norms.")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU activation in MLPs.")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="No biases in linear layers (experts included).")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="A bias on the QKV projection only, also under --disable-bias-linear "
                        "(Qwen2's attention).")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="Normalise the queries and keys with --normalization (megatron-core's "
                        "qk_layernorm): each query and key head (its channels) before RoPE, a "
                        "weight per channel shared by the heads (Qwen3's q_norm/k_norm); with "
                        "--multi-latent-attention the query and key/value latents "
                        "(DeepSeek's q_a_layernorm/kv_a_layernorm).")
    g.add_argument("--qk-layernorm-across-heads", action="store_true",
                   help="With --qk-layernorm and RMSNorm: normalise the whole query projection "
                        "and the whole key projection instead, over all their heads, a weight "
                        "per channel of each head (OLMoE's q_norm/k_norm); under tensor "
                        "parallelism the mean of squares spans every rank's heads.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Separate input embedding and output layer weights.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout after MLP/attention.")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Attention dropout.")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of lcm(this, MP) (Megatron-LM pads to "
                        "this x MP, which changes the model with the layout).")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="Layer implementation (Megatron-LM's flag): megatron-core's local "
                        "modules (the default here; they run everywhere, and use apex's fused "
                        "LayerNorm where apex is installed) or Transformer Engine's fused ones "
                        "(NVIDIA GPUs with transformer_engine installed; Megatron-LM's default).")
    g.add_argument("--attention-backend", choices=["flash", "fused", "unfused", "local", "auto"],
                   default="auto",
                   help="Attention kernels (megatron-core's AttnBackend): with --transformer-impl "
                        "transformer_engine, Transformer Engine's choice (auto) or the one named; "
                        "with local, megatron-core's unfused DotProductAttention whatever is "
                        "named (a start-up line says so for flash and fused).")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="Std of the normal weight init (output projections scaled by 1/sqrt(2L)).")
    mla_flags.add_flags(parser)
    mtp_flags.add_flags(parser)


def _moe_group(parser):
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="Experts E per MoE layer.")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="Expert FFN hidden size H (default --ffn-hidden-size).")
    g.add_argument("--moe-router-topk", type=int, default=2, help="Experts per token k.")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="Routing probabilities: the softmax over all experts' logits, taken at "
                        "the top k (default: the softmax over the top k logits). Needed for "
                        "--moe-router-topk 1, where a softmax over one logit has no gradient.")
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1,
                   help="Which layers are MoE (the others a dense MLP of --ffn-hidden-size): N, "
                        "every N-th layer from the first (1: all layers), or a Python list "
                        "expression of --num-layers 1s (MoE) and 0s (dense), e.g. "
                        "'([0]+[1]*7)' or '[1,0,1,0]' (Megatron-LM's forms).")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="Capacity factor f; tokens over capacity are dropped. None: dropless.")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="Pad each expert's input to its full capacity (fixed shapes).")
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs",
                   help="Which tokens to drop when over capacity.")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.01,
                   help="Weight of the load-balancing loss.")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="Weight of router z-loss.")
    g.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "allgather", "flex"],
                   default="alltoall", help="megatron-core dispatcher used by the megatron schedule.")
    moe_flags.add_flags(g)
    g.add_argument("--moe-parm-schedule", choices=["auto", "s1", "s2", "baseline", "megatron"],
                   default="auto",
                   help="MoE communication schedule: Parm's s1 (gate on split tokens) or s2 "
                        "(gate on all tokens, split the capacity), auto (the cheaper of the two "
                        "chosen at start-up: by the cost model from --moe-parm-cost-profile, or "
                        "else measured and cached; the default), the DeepSpeed-style baseline, "
                        "or megatron-core's own dispatcher.")
    g.add_argument("--moe-parm-exchange", choices=["exact", "direct", "padded"], default="exact",
                   help="s1's and s2's expert exchange: exact (each token sent once to each EP "
                        "rank holding one of its experts, in AlltoAlls of exact counts, its "
                        "outputs summed there and sent back as one row; where the EP group has "
                        "several ranks on each of its nodes and top-k > 1, sent once to each "
                        "node and forwarded inside it, two hops as DeepEP), direct (the same "
                        "in one hop, never relayed) or padded (the dispatched (E, C, M) layout, "
                        "every expert padded to the capacity; also chosen by "
                        "--moe-pad-expert-input-to-capacity).")
    g.add_argument("--moe-parm-local-first", action="store_true",
                   help="In the exact exchange (not relayed), compute the rows a rank sends to "
                        "its own EP rank apart, in two halves: one while the other ranks' rows "
                        "travel out, one while the outputs travel back. auto (measured at "
                        "start-up, or priced) tries it at --moe-parm-chunks 2 and sets it "
                        "where faster.")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="Each rank's experts in grouped GEMMs (Megatron-LM's flag): Transformer "
                        "Engine's TEGroupedMLP with --transformer-impl transformer_engine, else "
                        "megatron-core's GroupedMLP (--bf16 only, as megatron-core's; the "
                        "grouped_gemm package on GPUs, one matmul per expert on CPU). The "
                        "checkpoint is the same as without it.")
    g.add_argument("--moe-parm-cost-profile", default=None,
                   help="Cluster cost profile (JSON) for --moe-parm-schedule auto; default: a "
                        "built-in A100 profile (assumed numbers).")
    g.add_argument("--moe-parm-tune-cache", default=None,
                   help="Where auto keeps what it measured at start-up (JSON; default "
                        "$PARM_TRAINER_CACHE_DIR/moe_tune.json, else "
                        "~/.cache/parm_trainer/moe_tune.json; 'none': measure every time).")
    g.add_argument("--moe-parm-chunks", type=int, default=0,
                   help="Pipeline s1's and s2's expert exchange in this many pieces (of the "
                        "tokens; of the capacity slots with the padded exchange): the EP "
                        "AlltoAlls of later pieces run while earlier ones are gathered, "
                        "computed and sent back (1: no pipelining; 0, the default: chosen at "
                        "start-up, with a cost profile the depth the cost model predicts "
                        "fastest of 1, 2, 4, 8, else the fastest measured of 1, 2, 4).")


def _parallel_group(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="MP (tensor) size G.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline stages.")
    g.add_argument("--pipeline-model-parallel-layout", default=None,
                   help="megatron-core's layout string: the stages, split by |, of E (embedding), "
                        "t (decoder layer), L (loss), e.g. 'Ettt|tt|ttL', with (...)*n and x*n "
                        "repeating ('E|(tt|)*3,tL'; commas are cosmetic); more stages than "
                        "--pipeline-model-parallel-size give interleaved 1F1B (stage i on rank "
                        "i mod PP). 'auto': the stage builder's split of least predicted time.")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="Decoder layers on the first pipeline stage (default: an even split).")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="Decoder layers on the last pipeline stage (default: an even split).")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="Interleaved 1F1B: this many model chunks per pipeline rank.")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Interleaved 1F1B: this many layers per model chunk (even split only).")
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                   help="Interleaved 1F1B: batch each step's pipeline sends and receives instead "
                        "of overlapping them with compute (needs --pipeline-model-parallel-size "
                        "> 2).")
    g.add_argument("--memory-gb", type=float, default=None,
                   help="Per-rank memory (GiB) the layout must fit: the start-up estimate of "
                        "every pipeline rank is checked against it (a layout over it is refused "
                        "before training) and --pipeline-model-parallel-layout auto splits "
                        "within it.")
    g.add_argument("--memory-probe", action="store_true",
                   help="Measure this rank's memory in the first iteration (parameter, gradient "
                        "and optimizer bytes from the tensors; the activations autograd keeps, "
                        "at their peak over the micro-batches in flight) and log it beside the "
                        "estimate, max over data-parallel ranks, per pipeline rank. Slow.")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP size.")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="ESP (expert tensor parallel) size (default: the MP size).")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Split activations along the sequence over the MP group.")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard optimizer state over data-parallel ranks (ZeRO-1).")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Reduce gradients over data-parallel ranks in buckets during the "
                        "backward pass, overlapped with it (megatron-core DDP); a word "
                        "embedding tied to the output layer on the same stage gets a bucket of "
                        "its own, reduced from the start of the last micro-batch's backward (in "
                        "a model with MoE layers and without the distributed optimizer, in one "
                        "piece per MoE layer, each sent once the backward leaves that layer's "
                        "MoE block, between the layers' own exchanges). scripts/train_*.sh pass "
                        "it (OVERLAP_GRAD_REDUCE=0 does not).")
    g.add_argument("--no-overlap-grad-reduce", action="store_false", dest="overlap_grad_reduce",
                   help="Reduce gradients after the backward pass (the default; undoes an "
                        "--overlap-grad-reduce given before it).")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="With --use-distributed-optimizer and --overlap-grad-reduce: gather the "
                        "updated parameters bucket by bucket during the next forward pass, each "
                        "waited for by the first module that uses it (megatron-core DDP's "
                        "forward pre-hooks), instead of all at once after the optimizer step.")
    g.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                   help="Overlap the MoE layers' expert-parallel exchange with the computation "
                        "of another micro-batch: without pipeline parallelism the micro-batches "
                        "run in pairs that take turns, one computing while the other's exchange "
                        "travels (holds about one micro-batch of activations more); for Parm's "
                        "s1 and s2, whose exchange hands over at its AlltoAlls. "
                        "scripts/train_*.sh pass it (OVERLAP_MOE_COMM=0 does not).")
    g.add_argument("--no-overlap-moe-expert-parallel-comm", action="store_false",
                   dest="overlap_moe_expert_parallel_comm",
                   help="One micro-batch at a time (the default; undoes an "
                        "--overlap-moe-expert-parallel-comm given before it).")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="Parameters per gradient-reduction bucket (default: megatron-core's, "
                        "max(40M, 1M x data-parallel size)).")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="Default: nccl with CUDA, gloo without.")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="Ranks on each node, numbered node by node (default: LOCAL_WORLD_SIZE "
                        "as torchrun sets it, else one node); the exact MoE exchange relays "
                        "through nodes with it.")
    g.add_argument("--no-grad-reduce-by-node", action="store_false", dest="grad_reduce_by_node",
                   help="On gloo, all-reduce data-parallel gradients in gloo's one ring over "
                        "the group instead of node by node (the default where the group spans "
                        "nodes with the same ranks on each: summed inside each node, across the "
                        "nodes by one R-th per rank, sent back inside the node; the link then "
                        "carries 2(N-1)/N of the bytes instead of 2(D-1)/D; NCCL does as much "
                        "itself).")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="The process groups' timeout for a collective (fractions allowed: "
                        "0.5 = 30 s).")
    g.add_argument("--watchdog-timeout-minutes", type=float, default=None,
                   help="End the job when a rank makes no progress (no iteration step, no "
                        "save phase) for this long, naming the rank that stopped and where; "
                        "default: --distributed-timeout-minutes; 0: no watchdog.")


def _training_group(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2, help="Samples per micro-batch.")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per iteration (default micro x data-parallel size).")
    g.add_argument("--train-iters", type=int, default=None,
                   help="Iterations to train (default 100 unless --train-samples is given; "
                        "the two exclude each other).")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam", help="Optimizer.")
    g.add_argument("--lr", type=float, default=3e-4, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Final learning rate.")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="cosine", help="Decay after warmup.")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warmup iterations.")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="Iterations to decay over (default --train-iters).")
    g.add_argument("--train-samples", type=int, default=None,
                   help="Sample-based training: samples to train over all runs, instead of "
                        "--train-iters (the iterations follow from the global batch size and "
                        "its ramp-up, as in Megatron-LM).")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="Samples to decay the learning rate over, with --train-samples "
                        "(default --train-samples).")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="Samples to warm the learning rate up over, with --train-samples.")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warm up over this fraction of the decay (--lr-decay-iters or "
                        "--lr-decay-samples), instead of --lr-warmup-iters/--lr-warmup-samples.")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="The learning rate the warmup starts from.")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Ramp the global batch size up from START by INCREMENT to "
                        "--global-batch-size, in equal steps over the first SAMPLES samples "
                        "(megatron-core's calculator); with --train-samples as Megatron-LM, "
                        "and with --train-iters (as its GPT-3 recipe asks, which Megatron-LM "
                        "0.16 itself refuses) that many iterations of the ramped sizes.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Decoupled weight decay.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global gradient-norm clip.")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    g.add_argument("--seed", type=int, default=1234, help="Seed for init, data and dropout.")
    g.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPU).")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 mixed precision: the model in fp16, fp32 main weights in the "
                        "optimizer, the loss scaled (dynamically unless --loss-scale); a step "
                        "whose gradients overflow is skipped.")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="Static loss scale (a positive power of 2 helps fp16 converge). None "
                        "(or 0): dynamic loss scaling with --fp16.")
    g.add_argument("--initial-loss-scale", type=float, default=2**32,
                   help="Initial loss scale of dynamic loss scaling.")
    g.add_argument("--min-loss-scale", type=float, default=1.0,
                   help="Minimum loss scale of dynamic loss scaling.")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="Dynamic loss scaling doubles the scale after this many iterations "
                        "in a row without an overflow.")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="Dynamic loss scaling halves the scale at the overflowing iteration "
                        "that is this many since the start or the last increase, and at every "
                        "one after it until the next increase (megatron-core's "
                        "DynamicGradScaler).")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Stop (after saving) once the iteration is a multiple of this.")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="Save and stop at the first iteration boundary after this many minutes "
                        "since the process started (any rank's clock; as Megatron-LM's, which "
                        "takes whole minutes).")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On --exit-signal, finish the iteration, save a checkpoint and exit 0 "
                        "(every rank agrees at the iteration boundary).")
    g.add_argument("--exit-signal", default="SIGTERM", choices=EXIT_SIGNALS,
                   help="The signal --exit-signal-handler waits for (slurm's --signal).")
    g.add_argument("--manual-gc", action="store_true",
                   help="Turn Python's automatic garbage collector off and collect at chosen "
                        "iterations instead, so that no rank pauses for it at its own moment.")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="With --manual-gc: collect every this many iterations (0: at start-up "
                        "and around evaluations only).")
    g.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="With --manual-gc: do not collect before and after each evaluation.")


def _data_group(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Indexed dataset prefixes, optionally weighted: 'w1 p1 w2 p2'.")
    g.add_argument("--mock-data", action="store_true",
                   help="Train on synthetic data instead of --data-path: megatron-core's "
                        "MockGPTDataset (sequences of the tokenizer's vocabulary, no files).")
    g.add_argument("--split", default="969,30,1", help="Train,valid,test proportions.")
    add_tokenizer_flags(g)
    g.add_argument("--data-cache-path", default=None, help="Where dataset indices are cached.")
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader workers.")


def add_tokenizer_flags(group) -> None:
    """Megatron-LM's tokenizer flags, names and defaults (pretrain's data group and
    tools/preprocess_data.py take the same); parm_trainer/data/tokenizer.py reads them."""
    group.add_argument("--tokenizer-type", default=None,
                       help="SentencePieceTokenizer (--tokenizer-model), Llama2Tokenizer "
                            "(--tokenizer-model), GPT2BPETokenizer (--vocab-file, --merge-file) "
                            "NullTokenizer (--vocab-size) or HuggingFaceTokenizer "
                            "(--tokenizer-model: a directory saved by transformers, with "
                            "tokenizer.json). Default: GPT2BPETokenizer when "
                            "--vocab-file and --merge-file are given, else "
                            "SentencePieceTokenizer.")
    group.add_argument("--tokenizer-model", default=None,
                       help="Sentencepiece tokenizer model (HuggingFaceTokenizer: the directory).")
    group.add_argument("--vocab-file", default=None, help="Path to the vocab file.")
    group.add_argument("--merge-file", default=None, help="Path to the BPE merge file.")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="Size of vocab before EOD or padding.")


def default_tokenizer_type(args) -> str:
    """--tokenizer-type when none is given: Megatron-LM's GPT-3 recipe names only --vocab-file
    and --merge-file, and this project's scripts only --tokenizer-model."""
    if getattr(args, "vocab_file", None) and getattr(args, "merge_file", None):
        return "GPT2BPETokenizer"
    return "SentencePieceTokenizer"


def _eval_ckpt_log_group(parser):
    g = parser.add_argument_group("evaluation, checkpoints, logging")
    g.add_argument("--eval-interval", type=int, default=1000, help="Evaluate every n iterations.")
    g.add_argument("--eval-iters", type=int, default=10, help="Batches per evaluation.")
    g.add_argument("--save", default=None, help="Checkpoint directory to write.")
    g.add_argument("--load", default=None, help="Checkpoint directory to resume from.")
    g.add_argument("--save-interval", type=int, default=None, help="Save every n iterations.")
    g.add_argument("--no-load-optim", action="store_true", help="Load weights only.")
    g.add_argument("--no-save-optim", action="store_true",
                   help="Save the weights without the optimizer and LR-schedule state (a resume "
                        "from it starts them afresh, as --no-load-optim).")
    g.add_argument("--no-save-rng", action="store_true",
                   help="Save no RNG streams (a resume from it starts them from --seed).")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="Take the model's flags from the --load checkpoint's run.json (Megatron-"
                        "LM's list: sizes, attention, norms, experts and routing); sizes given "
                        "on the command line win, the rest are the checkpoint's. Without "
                        "--tokenizer-model (--vocab-file, --merge-file), the checkpoint's copy "
                        "of its tokenizer is used.")
    g.add_argument("--finetune", action="store_true",
                   help="Load the weights only and start at iteration 0 (no optimizer, LR "
                        "schedule, RNG or data position from the checkpoint).")
    g.add_argument("--no-load-rng", action="store_true",
                   help="Start the RNG streams from --seed instead of the checkpoint's.")
    g.add_argument("--ckpt-fallback", action="store_true",
                   help="If the latest checkpoint cannot be read (a truncated shard, missing "
                        "metadata), resume from the newest one that can, saying so.")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="Save the distributed optimizer's state per parameter (loads under any "
                        "layout; on by default here). --no-...: megatron-core's dp_reshardable "
                        "buffers, which load only under the same TP/PP/EP/ESP.")
    g.add_argument("--distrib-optim-fully-reshardable-mem-efficient", action="store_true",
                   help="Gather the optimizer state for a save on data-parallel rank 0 only "
                        "(less memory, a slower save).")
    g.add_argument("--async-save", action="store_true",
                   help="Write each save's shards in a forked process while training goes on; "
                        "the save is finalised (verdict, rename, tracker) at a later iteration "
                        "once every rank has written, and at the latest before the next save "
                        "and at the end.")
    g.add_argument("--log-interval", type=int, default=10, help="Log every n iterations.")
    g.add_argument("--log-throughput", action="store_true",
                   help="Add Megatron-LM's 'throughput per GPU (TFLOP/s/GPU)' to the log line "
                        "and a 'throughput' scalar to tensorboard and wandb.")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0,
                   help="Per log interval, where an iteration's time goes: 0 nothing timed; 1 "
                        "forward-backward, gradient sync, optimizer and data; 2 also megatron's "
                        "compute and pipeline timers and every MoE layer's plan steps "
                        "(forward, backward, the exchange's waits apart).")
    g.add_argument("--timing-log-option", choices=["max", "minmax", "all"], default="minmax",
                   help="Console report over ranks: the max, (min, max), or every rank's.")
    g.add_argument("--no-barrier-with-level-1-timing", action="store_false",
                   dest="barrier_with_L1_time",
                   help="Level-1 timers start without a barrier (the default synchronises the "
                        "ranks, so a time excludes waiting for a slower rank to arrive).")
    g.add_argument("--tensorboard-dir", default=None, help="Write tensorboard events here.")
    g.add_argument("--wandb-project", default=None, help="Log to this wandb project.")
    g.add_argument("--wandb-exp-name", default=None, help="wandb run name.")
    g.add_argument("--wandb-save-dir", default=None, help="wandb files (default under --save).")
    g.add_argument("--log-losses-json", default=None,
                   help="Write every iteration's losses to this JSON file (rank 0), after each "
                        "logged iteration; a resumed run keeps the entries up to its start.")


def add_bert_args(parser):
    g = parser.add_argument_group("BERT")
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                   help="No sentence-order head (and no token types): masked LM only.")
    g.add_argument("--mask-prob", type=float, default=0.15,
                   help="Share of tokens masked for the masked-LM loss.")
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="Probability of a sample shorter than --seq-length.")


class _DefaultsShown(argparse.HelpFormatter):
    """--help names each flag's default, as Megatron-LM's users look it up; a help text that
    already says what the default is keeps its own words."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text.lower() or action.default is argparse.SUPPRESS
                or not action.option_strings or isinstance(action, argparse._HelpAction)):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse's parser; under the project's launcher its error line goes to the launcher,
    which prints it last (error_line.py), after the usage."""

    def error(self, message):
        if error_line.keep(f"{self.prog}: error: {message}"):
            self.print_usage(sys.stderr)
            self.exit(2)
        super().error(message)


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    parser = _Parser(
        description="parm_trainer: MoE pretraining on megatron-core with Parm's schedules.",
        allow_abbrev=False, formatter_class=_DefaultsShown)
    for add in (_model_group, _moe_group, _parallel_group, _training_group, _data_group,
                _eval_ckpt_log_group, add_recompute_flags):
        add(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    add_megatron_only_flags(parser)
    return parser
