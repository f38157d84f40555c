# kube-vgpu developer workflow. `make install` then `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test lint bench demo e2e clean shim chart constraints

install: $(BIN)/kube-vgpu

$(BIN)/kube-vgpu: pyproject.toml setup.py constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	@touch $@

# Pin every installed package at its current version (after a change to pyproject.toml).
constraints: install
	{ echo "# Exact versions for reproducible installs: make install (CI) and docker/Dockerfile install with"; \
	  echo "# -c constraints.txt. Regenerate after changing pyproject.toml: make constraints"; \
	  $(BIN)/pip freeze | grep -v '^-e\|^kube-vgpu\|@ file\|^#' | sort -f; } > constraints.txt

test: install
	$(BIN)/python -m pytest tests

lint: install
	$(BIN)/ruff check .
	$(BIN)/python charts/tools/gen_schema.py --check
	$(BIN)/mypy kube_vgpu kube_vgpu_cli replay scheduler webhook deviceplugin certs kubectl_vgpu libvgpu benchmarks

bench: install
	$(BIN)/python benchmarks/run_all.py

demo: install
	$(BIN)/kube-vgpu replay

e2e: install
	$(BIN)/python -m pytest tests/e2e -m e2e -v

# Package the chart into dist/ (helm from $$HELM, else scripts/get_helm.py). VERSION=x.y.z (a
# release) must equal the chart's version and appVersion.
chart:
	@v="$$(sed -n 's/^version: *//p' charts/kube-vgpu/Chart.yaml)"; a="$$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}/\1/p' charts/kube-vgpu/Chart.yaml)"; \
	if [ -n "$(VERSION)" ] && { [ "$(VERSION)" != "$$v" ] || [ "$(VERSION)" != "$$a" ]; }; then \
		echo "VERSION=$(VERSION) but Chart.yaml has version $$v, appVersion $$a" >&2; exit 1; fi
	mkdir -p dist
	"$${HELM:-$$($(PY) scripts/get_helm.py)}" package charts/kube-vgpu --destination dist

clean:
	rm -rf build *.egg-info .pytest_cache .mypy_cache .ruff_cache
