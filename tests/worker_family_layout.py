"""Checkpoints under one parallel layout (run by tests/test_convert_families.py with torchrun):
for each, the logits of given token sequences and the greedy continuation of a prompt, as
tools/generate.py computes them (parm_trainer.generation), in one launch.

    torchrun --nproc-per-node 4 tests/worker_family_layout.py JOBS.json PROMPT [layout flags]

JOBS.json: [{"load": CKPT, "tokens": [[...]], "out": OUT.pt}]; OUT.pt gets the logits
(sequences x positions x the checkpoint's vocabulary) and the generated ids.
"""
import json
import sys

import torch

from parm_trainer.lazy_imports import eager_fusions_without_cuda

eager_fusions_without_cuda()


def main():
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from parm_trainer.compat import cpu
    from parm_trainer.data.tokenizer import tokenizer_from_args
    from parm_trainer.generation import _stage_forward, generate, generation_args
    from parm_trainer.models.config import transformer_config
    from parm_trainer.models.gpt import build_gpt_moe
    from parm_trainer.parallel import destroy_distributed, initialize_distributed
    from parm_trainer.planning.checks import validate_layout
    from parm_trainer.training.checkpoint import load_checkpoint

    jobs, prompt, layout = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3:]
    cpu.apply()
    for number, job in enumerate(jobs):
        own, args = generation_args(["--load-dir", job["load"], "--prompt", prompt,
                                     "--max-new-tokens", "20", *layout])
        validate_layout(args)
        if number == 0:
            initialize_distributed(args)
        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)
        model = build_gpt_moe(args, transformer_config(args), args.padded_vocab_size,
                              ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
        load_checkpoint(job["load"], [model], None, None, load_optimizer=False, load_rng=False)
        model.eval()
        tokenizer = tokenizer_from_args(args)
        vocab = getattr(args, "hf_vocab_size", None) or tokenizer.vocab_size
        logits = []
        with torch.no_grad():
            for sequence in job["tokens"]:
                output = _stage_forward(model, torch.tensor([sequence]), args.hidden_size)
                if ps.is_pipeline_last_stage():
                    logits.append(gather_from_tensor_model_parallel_region(output)[0, :, :vocab])
        ids = generate(model, tokenizer.tokenize(prompt), own, vocab, tokenizer.eod, args)
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 \
                and ps.get_data_parallel_rank() == 0:
            torch.save({"logits": torch.stack(logits), "ids": ids}, job["out"])
    destroy_distributed()


if __name__ == "__main__":
    main()
