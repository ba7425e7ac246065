# Fresh-machine entry points. Each target creates (or reuses) the virtual environment in $(VENV)
# and installs memtrain into it in editable mode, so `make quickstart` and `make test` are the only
# commands a new machine needs.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memtrain-installed

.PHONY: install quickstart demo-memory demo-crossattn reproduce-hmem reproduce-titans test test-fast bench clean

# A new environment takes 7.1 GB, most of it PyTorch's CUDA build and its NVIDIA libraries, and installing it
# from PyPI peaks at 10.9 GB (the downloaded wheels wait in a temporary folder until pip installs them; both
# measured 2026-11-29). The disk is checked first (tools/check_space.py, and TMPDIR's file system where it is
# another; INSTALL_GB=0 skips it), so a full disk stops in one line rather than as pip's "No space left on
# device" minutes in. --no-cache-dir: nothing is kept once installed.
INSTALL_GB ?= 11
$(STAMP): setup.py constraints.txt
	@test -x $(PY) || $(PYTHON) tools/check_space.py $(VENV) $(INSTALL_GB)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-cache-dir -c constraints.txt -e ".[dev]"
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

# The hierarchical-memories paper at small scale (reproduce/hmem.py, README "Reproducing the papers'
# effects"): the anchor alone, memories added to it (A2) or trained from scratch (A4), an anchor with as
# many parameters as anchor + fetched memory, and a bank-size sweep, all on the same tokens, scored on the
# long-tail probes by frequency bucket. Writes runs/reproduce/hmem.{json,md,png}; `--gpu` for one GPU.
reproduce-hmem: $(STAMP)
	$(PY) reproduce/hmem.py

# Titans Table 2 at small scale (reproduce/titans.py): LMM, MAC, a sliding-window and a full-attention
# transformer trained on the same tokens at a short context, S-NIAH / BABILong-style accuracy at 1x-8x it.
# Writes runs/reproduce/titans.{json,md,png}. `--gpu` sizes for one GPU: $(PY) reproduce/titans.py --gpu
reproduce-titans: $(STAMP)
	$(PY) reproduce/titans.py

# Two pytest-xdist workers (the suite is sized for 2 cores), each running one test file at a time, so a
# module's fixtures (a Slurm cluster's jobs, a shared 2-rank run) are set up once, on one worker.
PYTEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadfile

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/attention.py --quick
	$(PY) benchmarks/prepare.py --quick
	$(PY) benchmarks/titans.py --quick
	$(PY) benchmarks/bank_comm.py --quick
	$(PY) benchmarks/routed_attention.py --quick

clean:
	rm -rf runs data/quickstart data/quickstart-memory data/quickstart-crossattn data/reproduce-hmem data/reproduce-titans .pytest_cache
