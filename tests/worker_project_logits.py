"""The project's model on one rank, as the converter loads it, on given tokens: its logits to
a file (run by tests/test_convert.py and tests/test_bert_moe.py through conftest.python).

    python tests/worker_project_logits.py CKPT INPUTS.json OUT.pt

INPUTS.json: {"tokens": [[...]]} for a GPT (logits; with --mtp-num-layers N stacked with the
MTP layers', [1 + N, batch, sequence, vocabulary]: models.gpt.logits_with_mtp), or {"tokens",
"types", "mask"} for a BERT (masked-LM and sentence-order logits, a pair)."""
import json
import sys

import torch

from parm_trainer.convert.single_process import load_one_rank
from parm_trainer.models.gpt import logits_with_mtp

checkpoint, inputs, out = sys.argv[1:4]
model, _ = load_one_rank(checkpoint)
with open(inputs) as f:
    given = {name: torch.tensor(values) for name, values in json.load(f).items()}
tokens = given["tokens"]
with torch.no_grad():
    if "mask" in given:  # BERT
        logits = model(tokens, given["mask"], tokentype_ids=given["types"])
    elif getattr(model, "mtp", None) is not None:
        logits = torch.stack(logits_with_mtp(model, tokens,
                                             torch.arange(tokens.shape[1]).expand_as(tokens)))
    else:
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
torch.save(logits, out)
