# Two entry points: `make demo` (set up, then export -> build -> generate) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# On a machine without a GPU this takes the CPU build of torch; on a GPU machine install the CUDA build
# of torch into the venv first (any version the pyproject allows) and this step keeps it.
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)" || $(PY) -c "import torch"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

.PHONY: setup demo test bench
setup: $(VENV)/.installed

demo: setup
	$(PY) -m trtspec.testing llama models/demo-target --seed 0
	$(VENV)/bin/trtspec export models/demo-target -o export/demo-target --max-seq-len 256 --max-batch 2
	$(VENV)/bin/trtspec build export/demo-target -o engines/demo-target --backend onnxruntime
	$(VENV)/bin/trtspec generate --target engines/demo-target --drafter prompt_lookup -k 4 \
		--prompt "def add(a, b):" --max-new-tokens 48

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m pytest benchmarks -q --benchmark-disable-gc
