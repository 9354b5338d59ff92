# Two commands do all the set-up on a fresh machine:
#   make demo   installs moeplace into .venv and runs the main job on the built-in K3 default
#   make test   installs moeplace with its test extras into .venv and runs the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check
OUT    ?= run

.PHONY: demo dashboard test test-slow check-engines bench figures install install-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch through the extras, pinned by constraints.txt: the CPU wheel of 2.13.0 lies on disk; an unpinned
# resolve pulls a CUDA build. (The core install, `pip install moeplace`, needs no torch.)
$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -c constraints.txt -e '.[capture,kernels,dashboard,sweep,fast]'
	touch $@

$(VENV)/.installed-test: pyproject.toml constraints.txt $(VENV)/.installed
	$(PIP) -c constraints.txt -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(BIN)/place demo --out $(OUT)

# Explore what `make demo` wrote in the browser (http://localhost:8501).
dashboard: $(VENV)/.installed
	$(BIN)/place dashboard $(OUT)

# ruff first (seconds); the layer contract runs inside the suite (tests/test_layers.py)
test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not gpu"

test-slow: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m "slow"

# The vLLM load-time plugin inside released vLLM's own loader, on CPU (tests/test_vllm_engine.py says how
# far that goes). A separate environment: vLLM 0.34.0 --no-deps plus what its imported modules need.
ENGINES_VENV ?= .venv-engines
EPIP := $(ENGINES_VENV)/bin/python -m pip install --quiet --disable-pip-version-check

$(ENGINES_VENV)/.installed: pyproject.toml constraints.txt engines-requirements.txt
	$(PYTHON) -m venv $(ENGINES_VENV)
	$(EPIP) -c constraints.txt -e '.[capture]' -r engines-requirements.txt
	$(EPIP) --no-deps vllm==0.34.0
	touch $@

check-engines: $(ENGINES_VENV)/.installed
	$(ENGINES_VENV)/bin/python -c "import vllm; assert vllm.__version__ == '0.34.0', vllm.__version__"
	$(ENGINES_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py tests/test_vllm_plugin.py
	# a process of its own: vLLM resolves its platform once per process, and its parser needs the CPU one
	$(ENGINES_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_export_launch.py

bench: $(VENV)/.installed
	$(BIN)/python bench/trace_stats.py

# Rewrite the figures in README.md and docs/ from the committed bench/results/*.json.
figures: $(VENV)/.installed
	$(BIN)/python bench/figures.py

clean:
	rm -rf $(VENV) $(ENGINES_VENV) $(OUT) data/k3-default
