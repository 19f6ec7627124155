"""Text generation with a GPT-MoE checkpoint, under any TP/EP/ESP/PP layout (tools/generate.py).

    torchrun --nproc-per-node 4 tools/generate.py --load-dir runs/demo/checkpoints \\
        --prompt "The module" --tensor-model-parallel-size 2 --expert-model-parallel-size 2

The model flags come from the checkpoint's run.json, the layout from the command line. Every
step runs the whole sequence (no KV cache: simple, and these models are small): with pipeline
parallelism each stage receives the previous stage's hidden states and sends its own on. The
last stage gathers the last position's logits over tensor parallelism and picks the next token
(greedy by default, else sampled at --temperature from the --top-k most likely with --seed;
the vocabulary's padding rows are never chosen), and broadcasts it to every stage. It stops
after --max-new-tokens or at the end-of-document token.
"""

from __future__ import annotations

import argparse
import os

import torch

from parm_trainer.arguments import given_flags, model_argument_names, parse_args
from parm_trainer.parallel import rank_device
from parm_trainer.training.checkpoint import files


def _own_flags(argv):
    """This tool's flags; the rest (the layout, the tokenizer's) are pretrain's."""
    parser = argparse.ArgumentParser(
        prog="generate.py", add_help=False, allow_abbrev=False,
        description="Continue a prompt with a GPT-MoE checkpoint (its model flags and tokenizer "
                    "come from the checkpoint). The layout flags and the tokenizer's (given, "
                    "they win) are pretrain_gpt_moe.py's: see its --help.")
    parser.add_argument("-h", "--help", action="help", help="show this help and exit")
    parser.add_argument("--load-dir", required=True, help="a --save directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy.")
    parser.add_argument("--top-k", type=int, default=0, help="0: all tokens.")
    own, rest = parser.parse_known_args(argv)
    for flag, value in (("--max-new-tokens", own.max_new_tokens), ("--top-k", own.top_k),
                        ("--temperature", own.temperature)):
        if not (value >= 0 and value < float("inf")):
            parser.error(f"argument {flag}: must not be negative, got {value}")
    return own, rest


def generation_args(argv=None):
    """(generation flags, pretrain's args: the checkpoint's model, the command line's layout)."""
    own, rest = _own_flags(argv)
    try:
        path = files.latest_dir(own.load_dir)
        description = files.read_description(path)
    except files.CheckpointError as error:  # as tools/checkpoint/convert.py says it
        raise files.CheckpointError(f"--load-dir {error}") from None
    if description.get("model", "gpt") != "gpt":
        raise files.CheckpointError(
            f"--load-dir {own.load_dir} holds an MoE {description['model'].upper()} model; "
            f"tools/generate.py continues text with GPT-MoE checkpoints")
    saved = description["args"]
    args = parse_args(rest)
    for name in model_argument_names() - set(TOKENIZER_ARGS) | {"padded_vocab_size",
                                                                "hf_vocab_size"}:
        if name in saved:
            setattr(args, name, saved[name])
    given = given_flags(rest)
    _checkpoint_tokenizer(args, saved, path, own.load_dir, given)
    args.sequence_parallel = False  # a prompt of any length
    if "moe_parm_schedule" not in given:
        args.moe_parm_schedule, args.moe_parm_chunks = "s1", 1
    return own, args


TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")


def _checkpoint_tokenizer(args, saved: dict, path: str, load_dir: str, given: set) -> None:
    """The checkpoint's tokenizer: its type and --vocab-size from run.json, its files from the
    copies beside it (training/checkpoint/files.py). A tokenizer flag on the command line wins,
    as does the type that --vocab-file with --merge-file imply there."""
    from parm_trainer.data.input_files import TOKENIZER_FILE_FLAGS, check_tokenizer_flags

    implied = {"vocab_file", "merge_file"} <= given
    for dest in ("tokenizer_type", "vocab_size"):
        if not (dest in given or implied and dest == "tokenizer_type") and \
                saved.get(dest) is not None:
            setattr(args, dest, saved[dest])
    for dest in TOKENIZER_FILE_FLAGS.get(args.tokenizer_type, ()):
        if dest in given:
            continue
        copy = files.tokenizer_copy(args.tokenizer_type, dest)
        setattr(args, dest, os.path.join(path, copy))
        if not os.path.exists(getattr(args, dest)):
            raise files.CheckpointError(f"--load-dir {load_dir}: no {copy} in {path}; give "
                                        f"--{dest.replace('_', '-')}")
    check_tokenizer_flags(args)


def _next_token(logits: torch.Tensor, own, generator) -> int:
    if own.temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits / own.temperature
    if own.top_k > 0:
        floor = torch.topk(logits, min(own.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def _stage_forward(model, tokens: torch.Tensor, hidden_size: int):
    """This stage's output: hidden states [s, 1, h] (sent on to the next stage) or, on the last,
    the logits. A later stage first receives the earlier one's output."""
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_first_stage():
        received = torch.empty(tokens.shape[1], 1, hidden_size,
                               dtype=next(model.parameters()).dtype)
        torch.distributed.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(received)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    if getattr(model, "mtp_process", False) and ps.is_pipeline_last_stage():
        from parm_trainer.models.gpt import logits_with_mtp

        output = logits_with_mtp(model, tokens, positions)[0]  # the MTP layers' unused
    else:
        output = model(tokens, positions, None)
    if not ps.is_pipeline_last_stage():
        torch.distributed.send(output.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return output


@torch.no_grad()
def generate(model, prompt_ids: list, own, vocab_size: int, eod: int, args) -> list:
    """The generated ids (the prompt's continuation)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    generator = torch.Generator().manual_seed(args.seed)  # the same draws on every rank
    tp = args.tensor_model_parallel_size
    ids, new = list(prompt_ids), []
    for _ in range(own.max_new_tokens):
        if len(ids) >= args.max_position_embeddings:
            break
        length = -(-len(ids) // tp) * tp  # right padding: causal attention never sees it
        tokens = torch.tensor([ids + [eod] * (length - len(ids))])
        output = _stage_forward(model, tokens, args.hidden_size)
        token = torch.zeros(1, dtype=torch.long, device=rank_device())
        if ps.is_pipeline_last_stage():
            logits = gather_from_tensor_model_parallel_region(output)
            last = logits[0, len(ids) - 1, :vocab_size].float()
            token[0] = _next_token(last, own, generator)
        # every rank continues the same text: the last stage's token, in each pipeline
        torch.distributed.broadcast(token, src=ps.get_pipeline_model_parallel_last_rank(),
                                    group=ps.get_pipeline_model_parallel_group())
        ids.append(int(token))
        new.append(int(token))
        if int(token) == eod:
            break
    return new


def readable(tokenizer, ids: list) -> str:
    """The text of generated ids; an id past the tokenizer (a model whose embedding has more
    rows than its tokenizer has tokens) is written <id N>, where detokenizing it would fail."""
    size, out, run = tokenizer.vocab_size, [], []
    for token in ids:
        if token < size:
            run.append(token)
            continue
        if run:
            out.append(tokenizer.detokenize(run))
            run = []
        out.append(f"<id {token}>")
    if run:
        out.append(tokenizer.detokenize(run))
    return "".join(out)


def main(argv=None) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from parm_trainer.compat import cpu
    from parm_trainer.data.tokenizer import tokenizer_from_args
    from parm_trainer.models.config import transformer_config
    from parm_trainer.models.gpt import build_gpt_moe
    from parm_trainer.errors import LayoutError
    from parm_trainer.planning.checks import validate_layout
    from parm_trainer.parallel import destroy_distributed, initialize_distributed
    from parm_trainer.training.checkpoint import load_checkpoint
    from parm_trainer.training.user_errors import user_errors

    with user_errors():
        own, args = generation_args(argv)
        validate_layout(args)
        if args.virtual_pipeline_model_parallel_size or args.pipeline_stages is None:
            raise LayoutError("tools/generate.py runs one model chunk per pipeline rank: give "
                              "no virtual stages and no --pipeline-model-parallel-layout auto")
        tokenizer = tokenizer_from_args(args)
        cpu.apply()
        initialize_distributed(args)
        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)
        model = build_gpt_moe(args, transformer_config(args), args.padded_vocab_size,
                              ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
        load_checkpoint(own.load_dir, [model], None, None, load_optimizer=False, load_rng=False)
        model.eval()
        prompt_ids = tokenizer.tokenize(own.prompt)
        vocab = getattr(args, "hf_vocab_size", None) or tokenizer.vocab_size
        new = generate(model, prompt_ids, own, vocab, tokenizer.eod, args)
        if torch.distributed.get_rank() == 0:
            print(own.prompt + readable(tokenizer, new))
            print("prompt ids: " + " ".join(map(str, prompt_ids)))
            print("ids: " + " ".join(map(str, new)), flush=True)
        destroy_distributed()
