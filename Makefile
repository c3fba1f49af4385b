# Two entry points (see README): `make run` and `make test`. Both set up the locked environment first.
PY      ?= python3
UV      := .uv-bootstrap/bin/uv
VENV    := .venv
CONFIG  ?= configs/default.yaml
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export UV_PYTHON_DOWNLOADS := never

.PHONY: setup run test bench bench-torch ui clean

$(UV):
	$(PY) -m venv .uv-bootstrap
	.uv-bootstrap/bin/pip install --quiet uv==0.13.9

$(VENV)/.synced: $(UV) pyproject.toml uv.lock
	$(UV) sync --frozen --python $(PY)
	touch $@

setup: $(VENV)/.synced

run: setup
	$(VENV)/bin/ddiloco run $(CONFIG)

test: setup
	$(VENV)/bin/python -m pytest tests

bench: setup
	$(VENV)/bin/python benchmarks/throughput.py

# The same benchmark beside the PyTorch model of the same shape: an optional dependency, installed
# into the venv with pip (PyTorch's CPU build; `make run` and `make test` never need it).
bench-torch: setup
	$(VENV)/bin/python -m pip install --quiet -r benchmarks/requirements-torch.txt
	$(VENV)/bin/python benchmarks/throughput.py

ui: setup
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200 --analytics-off

clean:
	rm -rf .venv .uv-bootstrap
