# The two set-up commands: `make demo` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU wheel pinned first: an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
APT_PACKAGES := prometheus prometheus-alertmanager chromium

.PHONY: demo test bench lint check-deploy venv install-server install-test system-deps clean

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

# Debian packages the real-component tests need (Prometheus + promtool, Alertmanager + amtool, Chromium).
system-deps:
	@if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	  missing=""; \
	  command -v promtool >/dev/null || missing="$$missing prometheus"; \
	  command -v prometheus-alertmanager >/dev/null || missing="$$missing prometheus-alertmanager"; \
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

# Every deploy/ file through its own validator (also part of `make test`: tests/deploy/test_deploy.py).
check-deploy: install-test system-deps
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec deploy/compose.yaml
	for v in 1.28.0 1.31.0 1.34.0; do \
	  $(VENV)/bin/kubernetes-validate --strict --quiet -k $$v deploy/k8s/collector/collector.yaml deploy/k8s/node-local/daemonset.yaml deploy/k8s/monitoring/namespace.yaml \
	    deploy/k8s/components/kube-prometheus-stack/networkpolicy.yaml deploy/k8s/components/kube-prometheus-stack/grafana-*.yaml || exit 1; \
	done
	$(PY) deploy/k8s/check_operator_objects.py deploy/k8s/monitoring/servicemonitor.yaml deploy/k8s/monitoring/prometheusrule.yaml \
	  deploy/k8s/components/kube-prometheus-stack/alertmanagerconfig.yaml
	for k in deploy/k8s deploy/k8s/node-local deploy/k8s/kube-prometheus-stack deploy/k8s/kube-prometheus-stack/node-local; do \
	  kubectl kustomize $$k >/dev/null || exit 1; \
	done
	$(VENV)/bin/hadolint Dockerfile
	cd deploy && $(abspath $(VENV))/bin/yamllint --strict -c .yamllint.yaml .
	promtool check config --syntax-only deploy/prometheus/prometheus.yml
	promtool check rules deploy/prometheus/rules/vramwatch.rules.yml
	promtool test rules deploy/prometheus/tests/vramwatch.rules.test.yml
	amtool check-config deploy/alertmanager/alertmanager.yml
	$(PY) deploy/k8s/generate_prometheusrule.py --check
	$(PY) deploy/k8s/generate_grafana.py --check
	$(PY) deploy/grafana/build_dashboard.py --check
	$(PY) deploy/image_lock.py --check

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
