# The two entry points of the README. Both create or reuse .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned to the CPU wheel these machines carry (the range alone may pull a CUDA build).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/cachesmith models fetch smollm2-135m
	$(BIN)/cachesmith demo

test: $(STAMP)
	$(BIN)/cachesmith models fetch smollm2-135m
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/prefill.py

clean:
	rm -rf $(VENV) build *.egg-info
