"""Generate text with a GPT-MoE checkpoint, on one rank or under any TP/EP/ESP/PP layout.

    python tools/generate.py --load-dir runs/demo/checkpoints --prompt "The module"
    torchrun --nproc-per-node 4 tools/generate.py --load-dir runs/demo/checkpoints \\
        --prompt "The module" --tensor-model-parallel-size 2 --expert-model-parallel-size 2

Greedy unless --temperature T (with --top-k K). Prints the prompt and its continuation, then
`prompt ids: ...` and `ids: ...` (the generated ids), space separated. The model flags and the
tokenizer (its --tokenizer-type and the copies of its files) come from the checkpoint; a
tokenizer flag given here (--tokenizer-model, --vocab-file, ...) overrides it.
"""

import sys

from parm_trainer.process_exit import end
from parm_trainer.lazy_imports import eager_fusions_without_cuda, skip_wandb_unless_asked

skip_wandb_unless_asked(sys.argv)
eager_fusions_without_cuda()
from parm_trainer.generation import main

if __name__ == "__main__":
    end(main())
