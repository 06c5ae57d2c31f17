# All set-up on a fresh machine is done here: `make demo` and `make test` create .venv
# (torch 2.13.0 CPU build first, then npukit with its dev extras) when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.npukit-installed

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test lint demo bench browser clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard npukit/*/csrc/*)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check npukit tests benchmarks examples

# The main suite first (kept under 20 minutes on 2 cores), then the slow real-code suites.
test: lint
	$(PY) -m pytest -q -m "not slow"
	$(PY) -m pytest -q -m slow

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/demo.sh

bench: $(STAMP)
	for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# Headless Chromium for the browser check of the HTML reports (tests/e2e); CI runs this first.
browser:
	command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium chromium-driver; }

clean:
	rm -rf build npukit/npu_backend/*.so npukit/accuracy/*.so npukit/watch/*.so demo-out
