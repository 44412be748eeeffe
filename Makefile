# The two set-up commands: `make demo` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU wheel pinned first: an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
APT_PACKAGES := prometheus chromium

.PHONY: demo test bench lint venv install-server install-test system-deps clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

venv: $(PY)

$(VENV)/.server-installed: pyproject.toml | $(PY)
	$(PIP) install -q -e '.[server]'
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(PY)
	$(PIP) install -q '$(TORCH_PIN)'
	$(PIP) install -q -e '.[test]'
	touch $@ $(VENV)/.server-installed

install-server: $(VENV)/.server-installed
install-test: $(VENV)/.test-installed

# Debian packages the real-component tests need (Prometheus + promtool, Chromium).
system-deps:
	@if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	  missing=""; \
	  command -v promtool >/dev/null || missing="$$missing prometheus"; \
	  [ -x /usr/bin/chromium ] || missing="$$missing chromium"; \
	  if [ -n "$$missing" ]; then \
	    echo "installing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  fi; \
	else \
	  echo "not root: skipping apt-get; install $(APT_PACKAGES) yourself for the full suite"; \
	fi

demo: install-server
	$(VENV)/bin/vramwatch demo $(DEMO_ARGS)

test: install-test system-deps
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install-test system-deps
	$(PY) -m bench $(BENCH_ARGS)

lint: install-test
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
