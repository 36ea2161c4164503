# Two entry points: `make demo` (set up, then export -> build -> generate) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# On a machine without a GPU this takes the CPU build of torch; on a GPU machine install the CUDA build
# of torch into the venv first (any version the pyproject allows) and this step keeps it.
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)" || $(PY) -c "import torch"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,ray]'
	touch $@

.PHONY: setup demo test bench
setup: $(VENV)/.installed

TRTSPEC := $(VENV)/bin/trtspec
PROMPT ?= def list_python_files(top):

engines/stdlib-%/manifest.json: models/stdlib-%/config.json | setup
	$(TRTSPEC) export models/stdlib-$* -o export/stdlib-$* --max-seq-len 512 --max-batch 4
	$(TRTSPEC) build export/stdlib-$* -o engines/stdlib-$* --backend onnxruntime

demo: setup engines/stdlib-target/manifest.json engines/stdlib-draft/manifest.json
	$(TRTSPEC) generate --target engines/stdlib-target --draft engines/stdlib-draft -k 4 \
		--prompt "$(PROMPT)" --max-new-tokens 128

test: setup
	$(PY) -m pytest -q

bench: setup engines/stdlib-target/manifest.json engines/stdlib-draft/manifest.json
	$(TRTSPEC) bench --target engines/stdlib-target --draft engines/stdlib-draft --prompts models/heldout.json
	$(PY) benchmarks/bench_decode.py
	$(PY) benchmarks/bench_quant.py
	$(PY) benchmarks/bench_int4.py
	$(PY) benchmarks/bench_batching.py
	$(PY) benchmarks/bench_serve.py
	$(PY) benchmarks/bench_ray.py
	$(PY) -m pytest benchmarks -q
