# Fresh-machine entry points. Each target creates (or reuses) the virtual environment in $(VENV)
# and installs memtrain into it in editable mode, so `make quickstart` and `make test` are the only
# commands a new machine needs.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memtrain-installed

.PHONY: install quickstart demo-memory demo-crossattn test test-fast bench clean

$(STAMP): setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# A real training run on CPU with the built-in corpus: prepare shards, train, checkpoint, log.
quickstart: $(STAMP)
	$(VENV)/bin/memtrain prepare recipes/quickstart.yaml
	$(VENV)/bin/memtrain train recipes/quickstart.yaml

# Hierarchical memories on the built-in long-tail corpus (README, "Demonstration"): a small anchor
# co-trained with FFN memories and the same anchor on the same tokens without them, both evaluated on
# the corpus's fact probes by frequency bucket.
ANCHOR_ONLY := memory.type=none 'memory.levels=[]' run.name=quickstart-anchor
demo-memory: $(STAMP)
	$(VENV)/bin/memtrain prepare recipes/quickstart-memory.yaml
	$(VENV)/bin/memtrain train recipes/quickstart-memory.yaml
	$(VENV)/bin/memtrain train recipes/quickstart-memory.yaml $(ANCHOR_ONLY)
	$(VENV)/bin/memtrain eval recipes/quickstart-memory.yaml
	$(VENV)/bin/memtrain eval recipes/quickstart-memory.yaml $(ANCHOR_ONLY)

# Cross-attention memory banks on the same corpus (README, "Cross-attention memory banks"): the anchor with a
# routed shared bank of latent tokens, and the anchor alone on the same tokens, both scored on the fact probes.
CA_ANCHOR := memory.type=none memory.crossattn=null run.name=quickstart-crossattn-anchor
demo-crossattn: $(STAMP)
	$(VENV)/bin/memtrain prepare recipes/quickstart-crossattn.yaml
	$(VENV)/bin/memtrain train recipes/quickstart-crossattn.yaml
	$(VENV)/bin/memtrain train recipes/quickstart-crossattn.yaml $(CA_ANCHOR)
	$(VENV)/bin/memtrain eval recipes/quickstart-crossattn.yaml
	$(VENV)/bin/memtrain eval recipes/quickstart-crossattn.yaml $(CA_ANCHOR)

test: $(STAMP)
	$(VENV)/bin/pytest -q

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/attention.py --quick
	$(PY) benchmarks/prepare.py --quick
	$(PY) benchmarks/titans.py --quick
	$(PY) benchmarks/bank_comm.py --quick
	$(PY) benchmarks/routed_attention.py --quick

clean:
	rm -rf runs data/quickstart data/quickstart-memory data/quickstart-crossattn .pytest_cache
