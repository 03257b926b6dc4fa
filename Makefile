# The whole set-up on a fresh machine with only Python 3.11: `make demo`, `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
WORKDIR ?= runs/demo
PYTEST_ARGS ?=
# Two test processes keep both cores of a small machine busy (XLA compiles on one core); whole
# files go to one worker (--dist loadfile) so module fixtures are built once, and a worker that
# crashes fails the run at once (--max-worker-restart=0) instead of being replaced.
TEST_WORKERS ?= 2

.PHONY: demo test venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# One stamp per extra set, rebuilt when pyproject.toml changes.
$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e . 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import distillax, jax, flax, optax, orbax.checkpoint, grain, qwix"
	touch $@

# The demo ends in llama.cpp: the edge extra (llama-cpp-python builds llama.cpp once, ~5 min).
$(VENV)/.demo: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[edge]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import distillax, jax, flax, optax, orbax.checkpoint, grain, qwix, gguf, llama_cpp"
	touch $@ $(VENV)/.core

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,hf,edge]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import distillax, jax, pytest, xdist, torch, transformers, gguf, llama_cpp"
	touch $@ $(VENV)/.core $(VENV)/.demo

demo: $(VENV)/.demo
	$(BIN)/distillax demo --config distillax/configs/demo.py --workdir $(WORKDIR) --devices 8

test: $(VENV)/.test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs
