# The whole set-up on a fresh machine with only Python 3.11: `make demo`, `make test`.
# They install the exact versions of constraints.txt (pyproject.toml holds ranges), so CI is
# reproducible; `make test-latest` (not in CI) tries the newest releases inside those ranges.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
WORKDIR ?= runs/demo
PYTEST_ARGS ?=
# Two test processes keep both cores of a small machine busy (XLA compiles on one core); whole
# files go to one worker (--dist loadfile) so module fixtures are built once, the heaviest files
# first (--no-loadscope-reorder keeps tests/support/schedule.py's order), and a worker that
# crashes fails the run at once (--max-worker-restart=0) instead of being replaced.
TEST_WORKERS ?= 2

# make test-latest: Python 3.12 (the first that runs), a fresh venv, a short subset of the tests.
LATEST_PYTHON ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12; do \
  "$$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && echo "$$p" && \
  break; done)
LATEST_VENV := .venv-latest
# The engine and its backends, checkpoint resume after a SIGTERM, distillation, QAT, and the
# CLI's tiny runs of lm, distill, qat_distill and lora.
LATEST_TESTS ?= tests/framework/test_step.py tests/framework/test_backends.py::test_reference_run_learns \
  tests/framework/test_backends.py::test_collective_backends_agree_with_jit \
  tests/framework/run/test_checkpoint.py::test_restore_onto_another_topology \
  tests/trainers/test_base.py::test_sigterm_saves_the_current_step_and_the_next_run_resumes \
  tests/distill/test_objective.py tests/quant/test_qat.py \
  $(foreach c,lm distill qat_distill lora,'tests/test_configs.py::test_every_config_trains_on_tiny_overrides[$(c).py]')
# What test-latest prints and keeps in $(LATEST_VENV)/versions.txt.
LATEST_SHOWN := jax jaxlib flax optax orbax-checkpoint grain ml-collections clu qwix tensorboardX \
  safetensors tokenizers pyarrow numpy chex

.PHONY: demo test docs test-latest accelerator-wheels venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# One stamp per extra set, rebuilt when pyproject.toml or constraints.txt changes. pip installs
# without byte-compiling every module it unpacks (--no-compile): the test set's install took 96 s
# with it and 34 s without on a 2-core host (torch, transformers, libtpu...); Python compiles
# and caches only the modules a run imports, on first import (the checks below do most).
$(VENV)/.core: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e . 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import distillax, jax, flax, optax, orbax.checkpoint, grain, qwix"
	touch $@

# The demo ends in llama.cpp: the edge extra (llama-cpp-python builds llama.cpp once, ~5 min);
# its report scores every model with lm-eval and sacreBLEU: the eval extra.
$(VENV)/.demo: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e '.[edge,eval]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import distillax, jax, flax, optax, orbax.checkpoint, grain, qwix, gguf, llama_cpp, lm_eval, sacrebleu"
	touch $@ $(VENV)/.core

# The tests also compile the tiny jobs for a TPU (the aot extra: libtpu) and a GPU (the CUDA
# plugin of the aot-gpu extra, installed into $(AOT_GPU), off the import path: on a machine
# without a GPU it logs "Could not find cuda drivers" at every `import jax`; only
# `plan --target gpu:...` looks there, distillax/cli/target_env.py), and hold
# model.moe_impl='tokamax' to 'ragged' (the tokamax extra; tests/models/moe/test_kernels.py).
# speculators (the speculators extra) goes into $(SPECULATORS) with --no-deps: it asks for an
# older transformers than the hf extra's pin; tests/support/speculators.py puts it on the path.
AOT_GPU := $(VENV)/aot-gpu
SPECULATORS := $(VENV)/speculators
$(VENV)/.test: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e '.[test,hf,edge,aot,tokamax,eval,docs]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -m pip install -q --no-compile --no-deps --upgrade --target $(AOT_GPU) -c constraints.txt \
	  jax-cuda12-plugin jax-cuda12-pjrt 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -m pip install -q --no-compile --no-deps --upgrade --target $(SPECULATORS) -c constraints.txt \
	  speculators openai sniffio hs-connectors loguru 2>&1 | grep -v "is ignored" || true
	PYTHONPATH=$(SPECULATORS) $(BIN)/python -c "from speculators.models.eagle3 import Eagle3DraftModel"
	$(BIN)/python -c "import distillax, jax, pytest, xdist, torch, transformers, gguf, llama_cpp, libtpu, tokamax, lm_eval, sacrebleu, rouge_score, accelerate, mkdocs, material, mkdocstrings_handlers.python"
	test -d $(AOT_GPU)/jax_plugins/xla_cuda12
	touch $@ $(VENV)/.core $(VENV)/.demo $(VENV)/.docs

demo: $(VENV)/.demo
	$(BIN)/distillax demo --config distillax/configs/demo.py --workdir $(WORKDIR) --devices 8

# The documentation site, strictly (a broken link or reference fails), into site/. The config and
# CLI references and the benchmark pages are generated from the code and results at build time.
$(VENV)/.docs: pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install -q --no-compile -c constraints.txt -e '.[docs]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import distillax, mkdocs, material, mkdocstrings_handlers.python"
	touch $@ $(VENV)/.core

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Bytecode is written even where the environment sets PYTHONDONTWRITEBYTECODE: each xdist
# worker would otherwise rewrite every test module's asserts anew (~9 s a worker), and each of
# the suite's CLI and benchmark subprocesses compile distillax's modules from source again.
test: $(VENV)/.test
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0 $(PYTEST_ARGS)

# Newest releases inside pyproject's ranges (no constraints file), without the hf and edge extras
# (a newer torch is a multi-GB CUDA build; llama-cpp-python compiles). The venv is kept and
# upgraded eagerly on every run, so each run tests what the index serves that day.
test-latest:
	@test -n "$(LATEST_PYTHON)" || { echo "make test-latest: no Python 3.12 found; set LATEST_PYTHON=/path/to/python3.12" >&2; exit 2; }
	test -x $(LATEST_VENV)/bin/python || $(LATEST_PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
	$(LATEST_VENV)/bin/python -m pip install -q --no-compile --upgrade --upgrade-strategy eager -e '.[test]' 2>&1 | grep -v "is ignored" || true
	$(LATEST_VENV)/bin/python -c "import distillax, jax, flax, optax, orbax.checkpoint, grain, qwix"
	$(LATEST_VENV)/bin/python -c "import sys, importlib.metadata as m; print('python', sys.version.split()[0]); [print(n, m.version(n)) for n in sys.argv[1:]]" $(LATEST_SHOWN) | tee $(LATEST_VENV)/versions.txt
	$(LATEST_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 $(PYTEST_ARGS) $(LATEST_TESTS)

# Wheels scripts/accelerator_run.sh carries to a lent GPU/TPU machine (no network there).
accelerator-wheels:
	scripts/accelerator_wheels.sh .whl

clean:
	rm -rf $(VENV) $(LATEST_VENV) runs site
