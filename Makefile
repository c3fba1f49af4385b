# Two entry points (see README): `make run` and `make test`. Both set up the locked environment first.
PY      ?= python3
UV      := .uv-bootstrap/bin/uv
VENV    := .venv
CONFIG  ?= configs/default.yaml
UI_HOST ?= 127.0.0.1
UI_PORT ?= 4200
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export UV_PYTHON_DOWNLOADS := never
# ACCEL: which JAX wheels set-up installs from uv.lock. cuda (the `cuda` extra: JAX's CUDA 13 wheels)
# when nvidia-smi lists a GPU, else cpu; `make run ACCEL=cpu` forces CPU. Changing it re-syncs .venv.
ifeq ($(origin ACCEL),undefined)
ACCEL := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
endif
ifneq ($(words $(ACCEL)) $(filter cpu cuda,$(ACCEL)),1 $(strip $(ACCEL)))
$(error ACCEL='$(ACCEL)' is not one of: cpu cuda)
endif
EXTRAS_cpu  :=
EXTRAS_cuda := --extra cuda

.PHONY: setup browser run test test-fast lint bench bench-torch device-check ui docs docs-serve clean

$(UV):
	$(PY) -m venv .uv-bootstrap
	.uv-bootstrap/bin/pip install --quiet uv==0.13.9

# One stamp per ACCEL: switching removes the other one and re-syncs (exactly: cpu uninstalls the CUDA wheels).
# --compile-bytecode: the installed packages' .pyc files are written once here. Python reads them but,
# under PYTHONDONTWRITEBYTECODE (set on these machines), never writes them, so every process (CLI,
# Ray and Dask workers, Prefect's server) compiled JAX, Prefect and Ray afresh: 6.1 s → 2.6 s to
# import jax, prefect, flax and optax; 4.3 s → 1.4 s for ray and distributed.
$(VENV)/.synced-$(ACCEL): $(UV) pyproject.toml uv.lock
	rm -f $(VENV)/.synced $(VENV)/.synced-*
	$(UV) sync --frozen --compile-bytecode --python $(PY) $(EXTRAS_$(ACCEL))
	touch $@

setup: $(VENV)/.synced-$(ACCEL)

# Debian's Chromium for the browser test of the Prefect UI (tests/test_ui_browser.py, Playwright):
# installed with apt-get when missing and we are root; otherwise that test is skipped (fails under CI).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "chromium not found and not root with apt-get: tests/test_ui_browser.py will be skipped"; fi; }

run: setup
	$(VENV)/bin/ddiloco run $(CONFIG)

# The suite runs on CPU even where a GPU is (its golden losses and forced host devices are CPU's);
# JAX_PLATFORMS=cuda make test runs it on the GPU. TEST_WORKERS pytest-xdist workers share it: whole
# modules each, and the tests that start processes of their own one at a time on one worker
# (tests/conftest.py); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
ifeq ($(shell echo '$(TEST_WORKERS)' | grep -Ex '[0-9]+|auto'),)
$(error TEST_WORKERS='$(TEST_WORKERS)' is not a number of workers (0 for one process) or auto)
endif
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)
test: setup browser
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(VENV)/bin/python -m pytest tests $(XDIST)

# The edit loop's tier (docs/testing.md): every test but those marked slow, process, browser or
# network; one whole tiny pipeline among them. About 3.5 min on 2 idle cores.
test-fast: setup
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(VENV)/bin/python -m pytest tests -m "not slow and not process and not browser and not network"

# ruff (pyproject.toml's [tool.ruff]): lint and format check; `.venv/bin/ruff format .` and
# `.venv/bin/ruff check --fix .` fix most findings. `make test` runs the same checks (tests/test_lint.py).
lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: setup
	$(VENV)/bin/python benchmarks/throughput.py

# The same benchmark beside the PyTorch model of the same shape: an optional dependency, installed
# into the venv with pip (PyTorch's CPU build; `make run` and `make test` never need it).
bench-torch: setup
	$(VENV)/bin/python -m pip install --quiet -r benchmarks/requirements-torch.txt
	$(VENV)/bin/python benchmarks/throughput.py

# Backend and devices, every family's learner and DP step in float32 and bfloat16 (ms, MFU against the
# device's datasheet peak) and the default pipeline end to end (a few minutes): ARGS="--out DIR" keeps it.
device-check: setup
	$(VENV)/bin/python benchmarks/device_check.py $(ARGS)

# The Prefect UI stack: server, work pool local-proc, every deployment of prefect.yaml and a worker,
# started together; Ctrl-C stops them together (flows/ui_stack.py; logs in build/ui-stack/).
ui: setup
	$(VENV)/bin/ddiloco ui --host $(UI_HOST) --port $(UI_PORT)

# The documentation site (mkdocs.yml, docs/; the configuration reference is generated from the schema):
# `make docs` builds it strictly into site/, `make docs-serve` serves it with live reload.
export NO_MKDOCS_2_WARNING ?= 1
docs: setup
	$(VENV)/bin/python -m mkdocs build --strict

docs-serve: setup
	$(VENV)/bin/python -m mkdocs serve --dev-addr 127.0.0.1:8000

clean:
	rm -rf .venv .uv-bootstrap
