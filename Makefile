# Two commands do all the set-up on a fresh machine:
#   make chat   - venv + edgecloud[edge] + the default model, then one answer through the client
#   make test   - venv + edgecloud[dev] + the test models + vLLM in .venv-vllm, then the test suite
#                 (VLLM=0 skips the vLLM install; its tests are then skipped, saying why)
# llama-cpp-python compiles from source where no wheel fits (6-7 min on 2 cores, once: pip
# caches the built wheel).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPT ?= Write a Python function that reverses a string.
TEST_MODELS := smollm2-135m-instruct-q4 qwen2.5-coder-0.5b-instruct-q4 qwen2.5-coder-0.5b-instruct-iq4nl
PYTEST_ARGS ?=
# torch is installed before the package so pip does not resolve `torch>=2.4` to a multi-GB
# CUDA build; 2.13.0 is the CPU build on this project's machines. Elsewhere: make test TORCH=torch
TORCH  ?= torch==2.13.0
# llama.cpp is built for this CPU's SIMD extensions but without AMX (a native build crashes with
# "Illegal instruction" on VMs that do not grant AMX state); set CMAKE_ARGS yourself to override.
CMAKE_ARGS ?= $(shell $(PYTHON) scripts/llama_cmake_args.py)
export CMAKE_ARGS
# vLLM lives in its own venv (its pins disagree with ours); the tests find it there
VLLM       ?= 1
VLLM_VENV  ?= .venv-vllm
VLLM_SPEC  ?= $(shell $(PYTHON) scripts/vllm_spec.py)

.PHONY: chat test install install-dev models bench clean vllm

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip wheel

$(VENV)/.edge-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[edge]'
	touch $@

$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet '$(TORCH)'
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.edge-installed
install-dev: $(VENV)/.dev-installed

vllm:
	@if [ "$(VLLM)" = 1 ] && [ ! -e $(VLLM_VENV)/.installed ]; then \
	  PYTHON=$(PYTHON) scripts/install_vllm.sh $(VLLM_VENV) "$(VLLM_SPEC)"; fi

chat: install
	$(BIN)/edgecloud chat --prompt "$(PROMPT)"

models: install
	@for m in $(TEST_MODELS); do $(BIN)/edgecloud models pull $$m || exit 1; done

# pytest's exit 5 (no tests collected) counts as a failure.
test: install-dev vllm
	@for m in $(TEST_MODELS); do $(BIN)/edgecloud models pull $$m || exit 1; done
	@$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

bench: install-dev
	$(BIN)/python benchmarks/memory_accuracy.py
	$(BIN)/python benchmarks/edge_overhead.py
	$(BIN)/python benchmarks/edge_ttft.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info .pytest_cache
