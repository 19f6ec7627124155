# make demo   installs everything (.venv), builds the demo data, trains a small MoE GPT on 4 CPU ranks
# make demo-bert  the same for a small MoE BERT (sentence-level data, masked LM + sentence order)
# make test   installs everything, then runs the test suite
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
DATA   := data/demo
NPROC  ?= 4
TEST_WORKERS ?= 2

.PHONY: setup data data-bert demo demo-bert test test-fast clean-demo

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,hf]"
	touch $@

# transformers 4.x beside 5.x, imported only by the test that loads the exports in it
# (PYTHONPATH=$(VENV)/transformers4): its own huggingface_hub and tokenizers, the venv's torch
$(VENV)/transformers4/.installed: $(VENV)/.installed
	rm -rf $(VENV)/transformers4
	$(PY) -m pip install --quiet --no-deps --target $(VENV)/transformers4 \
		transformers==4.57.6 huggingface_hub==0.36.2 tokenizers==0.22.2
	touch $@

setup: $(VENV)/.installed $(VENV)/transformers4/.installed

$(DATA)/corpus.jsonl: | setup
	mkdir -p $(DATA)
	$(PY) tools/make_demo_corpus.py --output $@

$(DATA)/tokenizer.model: $(DATA)/corpus.jsonl
	$(PY) tools/train_tokenizer.py --input $< --json-keys text --output-prefix $(DATA)/tokenizer \
		--vocab-size 8000 --model-type bpe

$(DATA)/corpus_text_document.idx: $(DATA)/corpus.jsonl $(DATA)/tokenizer.model
	$(PY) tools/preprocess_data.py --input $(DATA)/corpus.jsonl --json-keys text \
		--output-prefix $(DATA)/corpus --tokenizer-type SentencePieceTokenizer \
		--tokenizer-model $(DATA)/tokenizer.model --append-eod --workers 2

data: $(DATA)/corpus_text_document.idx

# BERT reads one sequence per sentence; the tokenizer already holds [CLS], [SEP], [MASK], <pad>
$(DATA)/corpus_text_sentence.idx: $(DATA)/corpus.jsonl $(DATA)/tokenizer.model
	$(PY) tools/preprocess_data.py --input $(DATA)/corpus.jsonl --json-keys text \
		--output-prefix $(DATA)/corpus --tokenizer-type SentencePieceTokenizer \
		--tokenizer-model $(DATA)/tokenizer.model --split-sentences --workers 2

data-bert: $(DATA)/corpus_text_sentence.idx

demo: setup data
	PYTHON=$(PY) NPROC=$(NPROC) bash scripts/demo_gpt_moe.sh

demo-bert: setup data-bert
	PYTHON=$(PY) NPROC=$(NPROC) bash scripts/demo_bert_moe.sh

# two workers on 2 cores: a launch's ranks spend much of their time waiting on each other's
# gloo messages with the cores idle, which the other worker's test fills (tests/conftest.py and
# sharing_fixtures.py: tests that share the machine's namespaces never run two at once, tests
# marked `alone` with no other). Three were slower (1308 s against 1198 s on 2026-12-07, with
# the tests that time a failure kept to one other) or broke those tests' bounds.
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests --cpu-top 15

# the tests that start no process (marked in tests/conftest.py from their code): under a minute
test-fast: setup
	$(PY) -m pytest -q -m "not launches" tests

clean-demo:
	rm -rf $(DATA) runs/demo runs/demo_bert
