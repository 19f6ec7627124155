"""Logits and a greedy continuation of checkpoints under a layout given on the command line
(run by tests/test_convert_deepseek.py through conftest.torchrun).

    torchrun --nproc-per-node 4 tests/worker_layout_logits.py INPUTS.json OUT.pt CKPT... \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ...

INPUTS.json: {"tokens": [[...]], "prompt": [...], "eod": ID, "vocab": SIZE}; OUT.pt: for each
checkpoint, its logits on the tokens (gathered from the last stage's tensor-parallel ranks)
and the 20 ids parm_trainer.generation.generate continues the prompt with."""
import json
import sys

import torch

from parm_trainer.generation import _stage_forward, generate, generation_args


def _run(load_dir, layout, given, first):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from parm_trainer.models.config import transformer_config
    from parm_trainer.models.gpt import build_gpt_moe
    from parm_trainer.parallel import initialize_distributed
    from parm_trainer.training.checkpoint import load_checkpoint

    own, args = generation_args(["--load-dir", load_dir, "--prompt", "-"] + layout)
    if first:  # the groups of the layout, for every checkpoint
        initialize_distributed(args)
        model_parallel_cuda_manual_seed(args.seed)
    model = build_gpt_moe(args, transformer_config(args), args.padded_vocab_size,
                          ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    load_checkpoint(load_dir, [model], None, None, load_optimizer=False, load_rng=False)
    model.eval()
    with torch.no_grad():
        logits = [None] * len(given["tokens"])
        for i, row in enumerate(given["tokens"]):  # one sequence at a time, as generation runs
            output = _stage_forward(model, torch.tensor([row]), args.hidden_size)
            if ps.is_pipeline_last_stage():
                logits[i] = gather_from_tensor_model_parallel_region(output)[0]
    ids = generate(model, given["prompt"], own, given["vocab"], given["eod"], args)
    last = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    return (torch.stack(logits), ids) if last else None


def main():
    from parm_trainer.compat import cpu
    from parm_trainer.parallel import destroy_distributed

    inputs, out, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    count = next(i for i, word in enumerate(rest) if word.startswith("--"))
    directories, layout = rest[:count], rest[count:]
    given = json.load(open(inputs))
    cpu.apply()
    results = [_run(d, layout, given, i == 0) for i, d in enumerate(directories)]
    if results[0] is not None:  # the last stage's first tensor-parallel rank
        torch.save(results, out)
    destroy_distributed()


if __name__ == "__main__":
    main()
