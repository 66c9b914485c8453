# nvhook developer tasks. `make demo` and `make test` are the README's two first commands: on a
# fresh Debian 12 machine they install what they need (.ci/deps, as root or through sudo).
# Real targets and stamps: a second `make demo` with nothing changed only prints the plan.
PY      ?= python3
VENV    ?= .venv
VPY      = $(VENV)/bin/python
FIXTURES = tests/fixtures/rootfs
# The venv is up to date when it is newer than pyproject.toml; the fixtures when their stamp
# is newer than their generator and C sources.
VENV_OK  = $(VENV)/.nvhook-installed
FIX_OK   = $(FIXTURES)/.stamp
FIX_SRC  = tests/fixtures/make_fixtures.py $(wildcard tests/fixtures/src/*.c)
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

.PHONY: deps venv fixtures demo test test-fast test-pythons bench wheel deb clean node test-node-matrix FORCE

deps:
	@.ci/deps demo

# The strict editable install links each file: a module added (or removed) since needs a
# reinstall, so the list of files is a prerequisite, rewritten only when it changes.
MODULES := $(sort $(shell find nvhook -name '*.py' -o -path 'nvhook/data/*' 2>/dev/null))
$(VENV)/.nvhook-modules: FORCE
	@mkdir -p $(VENV)
	@echo '$(MODULES)' | cmp -s - $@ || echo '$(MODULES)' > $@

# Strict editable mode: a static path in a .pth, no import hook on the hook's start path (the
# default mode's finder costs ~9 ms per container start). setuptools announces that mode with a
# boxed notice (new modules need a reinstall: the module list above sees to it).
$(VENV_OK): pyproject.toml $(VENV)/.nvhook-modules
	@.ci/deps demo
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" \
	    $(VPY) -m pip install -q -e '.[test]' --config-settings editable_mode=strict
	$(VPY) -I -m nvhook.base.modbundle
	touch $@

venv:
	rm -f $(VENV_OK)
	$(MAKE) $(VENV_OK)

$(FIX_OK): $(VENV_OK) $(FIX_SRC)
	$(VPY) tests/fixtures/make_fixtures.py

fixtures: $(FIX_OK)

# nvhook's main job against the bundled fixture host: print the plan for a container that
# asks for GPU 0 with compute,utility. No GPU needed; nothing is changed.
demo: $(FIX_OK)
	$(VENV)/bin/nvhook --root $(FIXTURES)/host-gpu8 --dry-run --bundle $(FIXTURES)/bundle-container-debian

test: $(FIX_OK)
	@.ci/deps test
	@$(VPY) -I -m nvhook.base.modbundle  # the start-path bundle of the sources as they are now
	$(VPY) -m pytest -q

# The lint gate CI runs before the tests (seconds): ruff, and mypy as pyproject.toml configures it
# (decide/ and base/ strictly typed), at the versions pinned by the `lint` extra there.
.PHONY: lint
LINT_PINS = from nvhook.base import tomlread; print("\n".join(tomlread.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["lint"]))
lint: $(VENV_OK)
	$(VPY) -c '$(LINT_PINS)' | $(VPY) -m pip install -q -r /dev/stdin
	$(VENV)/bin/ruff check nvhook tests bench
	$(VENV)/bin/mypy

# nvhook runs on the host's own python3, 3.9 to 3.13 (docs/python-versions.md): the unit tests
# on each of the others (a venv each: .venv-3.9 ...), the container tests on 3.9 and 3.13, and
# the wheel installed and run on each (.ci/test-pythons says how; PYTHONS=... to choose, or
# UNIT_PYTHONS and WHEEL_PYTHONS apart).
test-pythons: $(FIX_OK)
	@.ci/deps pythons
	.ci/test-pythons $(STEPS)

test-fast: $(FIX_OK)
	$(VPY) -m pytest -q -m 'not runc and not podman and not node'

# The node roots the node tests run their engines from (docs/testing-node.md): Debian 13's
# (containerd 1.7) and Debian unstable's (containerd 2.1), each with its systemd layer, built
# with debootstrap into /var/cache/nvhook-tests once per machine (a few minutes each), then
# reused. The node tests build them themselves when missing; this target does it ahead of them.
node: $(VENV_OK)
	@.ci/deps test
	for suite in trixie sid; do \
	    $(VPY) tests/node/noderoot.py --suite $$suite && $(VPY) tests/node/sdnode.py --suite $$suite || exit 1; done

# The node tests on both roots in full (what CI leaves out: docs/testing-node.md).
test-node-matrix: $(FIX_OK)
	@.ci/deps test
	NVHOOK_NODE_SUITES=trixie,sid $(VPY) -m pytest -q tests/node

bench: $(FIX_OK)
	@$(VPY) -I -m nvhook.base.modbundle
	$(VPY) bench/bench.py $(if $(REFERENCE),--reference $(abspath $(REFERENCE))) $(BENCH_ARGS)

# The wheel an operator installs (pure Python: no compiler on the GPU nodes).
wheel: dist/nvhook-$(VERSION)-py3-none-any.whl

dist/nvhook-$(VERSION)-py3-none-any.whl: $(VENV_OK) pyproject.toml $(shell git ls-files nvhook bin config oci-hooks.d 2>/dev/null)
	$(VPY) -m pip wheel -q --no-deps -w dist .

# A Debian package: nvhook and its pure-Python dependencies in /usr/lib/nvhook (no venv),
# launchers in /usr/bin, config and hooks file where Debian expects them (packaging/build-deb).
deb: dist/nvhook-$(VERSION)-py3-none-any.whl
	@.ci/deps deb
	# the venv's pip (upgraded by `make venv`): Debian 12's pip 23.0 resolves dependencies for
	# --python-version 3.9 with releases that need a newer Python; build-deb refuses those
	PYTHON=$(VPY) packaging/build-deb dist/nvhook-$(VERSION)-py3-none-any.whl dist

clean:
	rm -rf $(FIXTURES)/*/ $(FIXTURES)/*.json $(FIX_OK) .pytest_cache .hypothesis dist build
