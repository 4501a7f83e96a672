# The two entry points of the README. Both create or reuse .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup system-deps bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned to the CPU wheel these machines carry (the range alone may pull a CUDA build).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

# The redis tier's tests run a real redis-server (Debian package); install it when missing.
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else echo "redis-server is missing: sudo apt-get install redis-server" >&2; exit 1; fi; }

demo: $(STAMP)
	$(BIN)/cachesmith models fetch smollm2-135m
	$(BIN)/cachesmith demo

test: $(STAMP) system-deps
	$(BIN)/cachesmith models fetch smollm2-135m
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/prefill.py

clean:
	rm -rf $(VENV) build *.egg-info
