"""The project's model on one rank, as the converter loads it, on given tokens: its logits to
a file (run by tests/test_convert.py and tests/test_bert_moe.py through conftest.python).

    python tests/worker_project_logits.py CKPT INPUTS.json OUT.pt

INPUTS.json: {"tokens": [[...]]} for a GPT (logits), or {"tokens", "types", "mask"} for a BERT
(masked-LM and sentence-order logits, a pair)."""
import json
import sys

import torch

from parm_trainer.convert.single_process import load_one_rank

checkpoint, inputs, out = sys.argv[1:4]
model, _ = load_one_rank(checkpoint)
with open(inputs) as f:
    given = {name: torch.tensor(values) for name, values in json.load(f).items()}
tokens = given["tokens"]
with torch.no_grad():
    if "mask" in given:  # BERT
        logits = model(tokens, given["mask"], tokentype_ids=given["types"])
    else:
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
torch.save(logits, out)
