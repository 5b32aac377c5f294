# Two commands on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch (an unpinned `pip install torch` pulls GBs of CUDA packages): from the sources pip is set
# up with where one has it, else from PyTorch's CPU index (PyPI has no +cpu builds).
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP  := $(VENV)/.installed

.PHONY: install bytecode test bench demo proto docs clean prometheus

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)" --index-url "$(TORCH_INDEX)"
	$(PY) -m pip install -q -e ".[test,bench]"
	# nvidia-resiliency-ext 0.4.1 pulls in the deprecated pynvml shim beside nvidia-ml-py; the shim's import hook makes
	# torch warn in every process. nvidia-ml-py provides the same module.
	$(PY) -m pip uninstall -q -y pynvml
	touch $(STAMP)

install: $(STAMP)

# The project's own modules compiled once, before the processes that import them start: where Python is told to
# write no bytecode (PYTHONDONTWRITEBYTECODE, set on CI machines like this one) every worker, daemon and test process
# compiled them again, 0.25 s of CPU each. Only what changed since the last run is compiled again.
bytecode: $(STAMP)
	@$(PY) -m compileall -q ffstate bench testing demo kernels tests

# Two workers: the whole-job tests (torchrun, timed in steps) one after another on one, the rest beside them
# (tests/conftest.py). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: $(STAMP) bytecode prometheus
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# Debian's Prometheus server, for the dashboard's test (tests/system/test_dashboard.py): installed where it is missing
# and this runs as root with apt-get (CI); elsewhere that test is skipped, saying why.
prometheus:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q prometheus >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q prometheus >/dev/null 2>&1; }; }; } || \
	  echo "Debian's prometheus is not installed (needs root and apt-get): the dashboard's test will be skipped"

# Regenerates the gRPC stubs in ffstate/_proto/ from proto/ (checked in; a test checks they are current).
proto: $(STAMP)
	$(PY) proto/generate.py

# Regenerates docs/configuration.md from Config, DaemonConfig and `ffstate serve`'s flags (a test checks it is current).
docs: $(STAMP)
	$(PY) -m ffstate.configdoc > docs/configuration.md

bench: $(STAMP) bytecode
	$(VENV)/bin/ffstate bench codec

# The main job: torchrun, 4 ranks as 2 simulated nodes, a rank and then a node SIGKILLed, recovery from
# peers, and a bit-for-bit comparison with the same run without failures.
demo: $(STAMP) bytecode
	$(VENV)/bin/ffstate demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
