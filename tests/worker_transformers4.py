"""Load exported checkpoints in transformers 4.x (PYTHONPATH: make setup's .venv/transformers4)
and print one JSON line: each directory's model class, logits on given sequences and its
tokenizer's ids of given texts (run by tests/test_convert.py, in a Python of its own).

    python tests/worker_transformers4.py '[[DIRECTORY, SEQUENCES, TEXTS], ...]'"""
import json
import sys

import torch
import transformers

assert transformers.__version__.startswith("4."), transformers.__version__
out = {"version": transformers.__version__}
for directory, sequences, texts in json.loads(sys.argv[1]):
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        logits = model(torch.tensor(sequences)).logits
    out[directory] = {"class": type(model).__name__, "logits": logits.tolist(),
                      "ids": [tokenizer(text)["input_ids"] for text in texts]}
print(json.dumps(out))
