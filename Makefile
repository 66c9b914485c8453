# nvhook developer tasks. `make demo` and `make test` are the README's two first commands.
PY      ?= python3
VENV    ?= .venv
VPY      = $(VENV)/bin/python
FIXTURES = tests/fixtures/rootfs

.PHONY: venv fixtures demo test test-fast bench clean

$(VPY):
	$(PY) -m venv $(VENV)

venv: $(VPY)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]' --config-settings editable_mode=compat

fixtures: venv
	$(VPY) tests/fixtures/make_fixtures.py

# nvhook's main job against the bundled fixture host: print the plan for a container that
# asks for GPU 0 with compute,utility. No GPU needed; nothing is changed.
demo: fixtures
	$(VENV)/bin/nvhook --root $(FIXTURES)/host-gpu8 --log-file '' --dry-run --bundle $(FIXTURES)/bundle-container-debian

test: fixtures
	$(VPY) -m pytest -q

test-fast: fixtures
	$(VPY) -m pytest -q -m 'not runc and not podman'

bench: fixtures
	$(VPY) bench/bench.py $(if $(REFERENCE),--reference $(abspath $(REFERENCE))) $(BENCH_ARGS)

clean:
	rm -rf $(FIXTURES)/*/ $(FIXTURES)/*.json .pytest_cache .hypothesis
