"""Session fixtures for the node tests (tests/node/, marker `node`): one private Debian node per
test session and root (tests/node/node.py), with the local images imported and nvhook installed.
Every test that uses a node runs once per root (`node_inputs` is parametrized): [trixie]
(containerd 1.7) and [sid] (containerd 2.1); NVHOOK_NODE_SUITES=trixie (or sid) runs one.

- `node`: the running Node (containerd with CDI, nvhook's runtime handler "nvidia", the
  8-GPU fixture host as the driver). Tests share it: each removes its own pods (`pods` fixture).
- `kubelet`: node.kubelet, pods removed after each test whatever it did.

The first session on a machine builds the cached roots (noderoot.py, a few minutes each);
later ones start in seconds. Everything skips with the reason where the machine cannot (not
root, no debootstrap, no grpcio).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "e2e"))

import machinestate  # noqa: E402
import noderoot  # noqa: E402
import privaterun  # noqa: E402

# The machine's own containerd, Docker, podman and services: config, state and units exactly as
# before (the node's dockerd and podman have their own). (Not /var/lib/docker: the machine's
# own dockerd may be writing there. Not /run/containerd: other suites' private containerds put
# their shims' sockets in /run/containerd/s whatever their state directory, while this node's
# go to its own /run.)
MACHINE_PATHS = ("/etc/containerd", "/var/lib/containerd", "/etc/systemd/system", "/lib/systemd/system",
                 "/etc/docker", "/etc/containers")


def machine_snapshot() -> dict:
    """The machine's engine files (tests/machinestate.py: two levels deep, absent tops too), as
    the machine sees them (the run is in a mount namespace of its own, tests/e2e/privaterun.py)."""
    return machinestate.snapshot(MACHINE_PATHS, privaterun.machine_root())


def _skip_reason() -> str | None:
    reason = noderoot.cannot_build()
    if reason:
        return reason
    try:
        import grpc  # noqa: F401
        import grpc_tools  # noqa: F401
    except ImportError:
        return "grpcio and grpcio-tools are not installed (pip install -e '.[test]')"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(str(HERE)):
            item.add_marker(pytest.mark.node)


def node_suites() -> list[str]:
    """The node roots this run uses: NVHOOK_NODE_SUITES (comma-separated: trixie, sid), default
    both (docs/testing-node.md says which CI runs)."""
    wanted = [s.strip() for s in os.environ.get("NVHOOK_NODE_SUITES", ",".join(noderoot.SUITES)).split(",") if s.strip()]
    unknown = [s for s in wanted if s not in noderoot.SUITES]
    if unknown:
        raise pytest.UsageError(f"NVHOOK_NODE_SUITES: unknown suite {unknown[0]!r}: one of {', '.join(noderoot.SUITES)}")
    return wanted


class NodeInputs(dict):
    """The images every node of the session imports ({ref: archive}), and the suite of the root
    it runs (start_node reads `suite`)."""

    suite = noderoot.SUITE


@pytest.fixture(scope="session")
def node_images(tmp_path_factory):
    """The images, built once for every node of the session, whatever its root."""
    reason = _skip_reason()
    if reason:
        pytest.skip(f"node tests: {reason}")
    import images

    work = tmp_path_factory.mktemp("node-build")
    return images.build_all(work / "images")


@pytest.fixture(scope="session", params=node_suites())
def node_inputs(request, node_images):
    """What a node of this session is made of: the root of one suite (each node test runs once
    per suite: [trixie] with containerd 1.7, [sid] with containerd 2.1), and the images."""
    suite = request.param
    reason = noderoot.cannot_build(suite)
    if reason:
        pytest.skip(f"node tests on {suite}: {reason}")
    try:
        noderoot.ensure(suite=suite)  # the long step first, with nothing else to clean up if it fails
    except subprocess.CalledProcessError as e:
        log = noderoot.build_log(suite)
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        pytest.fail(f"building the {suite} node root failed ({' '.join(map(str, e.cmd))[:200]}: exit {e.returncode}); "
                    f"log {log}:\n{tail}")
    inputs = NodeInputs(node_images)
    inputs.suite = suite
    return inputs


@pytest.fixture(scope="session")
def machine_untouched():
    """Fails the session's teardown when the machine's own engine files changed meanwhile."""
    before = machine_snapshot()
    yield
    after = machine_snapshot()
    changed = machinestate.changed(before, after)
    assert not changed, f"the machine's own engine files changed: {changed[:20]}"


def _node(fixtures_root, node_inputs, cgroup: str):
    from node import start_node

    n = start_node(fixtures_root / "host-gpu8", node_inputs, cgroup=cgroup)
    try:
        yield n
    finally:
        problems = n.close()
        assert not problems, problems


@pytest.fixture(scope="session")
def node(machine_untouched, fixtures_root, node_inputs):
    """The session's node on the machine's own cgroup hierarchy."""
    yield from _node(fixtures_root, node_inputs, "host")


@pytest.fixture(scope="module")
def node_v2(machine_untouched, fixtures_root, node_inputs):
    """A node whose /sys/fs/cgroup is cgroup2 (mounted in its namespace: runc and containerd
    then run in v2 mode and filter devices with BPF), on a machine that boots hybrid too."""
    yield from _node(fixtures_root, node_inputs, "v2")


@pytest.fixture
def kubelet(node):
    k = node.kubelet
    yield k
    k.remove_all()


# An operator's daemon.json before nvhook: CDI on (Docker 26 reads CDI specs only with it, and
# cannot have it turned on by a reload), laid out by hand; `node uninstall` must give back
# these bytes.
DAEMON_JSON = '{\n  "features": { "cdi": true },\n\n  "log-level": "info"\n}\n'


@pytest.fixture(scope="session")
def engines_node(machine_untouched, fixtures_root, node_inputs):
    """A node for the engines beside containerd's CRI: containerd 1.7 or 2.1, Docker 26 or 28.5 (its own
    dockerd, CDI on in the operator's daemon.json) and podman 5, the images in each, and nvhook
    put there by `nvhook node install --runtime docker` (runtime `nvidia`, the CDI spec
    /etc/cdi/nvhook.json, /opt/nvhook with bin/nvidia-cdi-hook). `engines_node.before_install`:
    the node's files (node_tree) before it, for the uninstall test."""
    from node import DOCKER_CONFIG, HOST_ROOT, node_install, node_tree, start_node

    images = node_inputs
    n = start_node(fixtures_root / "host-gpu8", images, install=False)
    try:
        n.write(DOCKER_CONFIG, DAEMON_JSON)
        n.start_dockerd()
        n.load_images({ref: a for ref, a in images.items() if "pause" not in ref})
        n.before_install = node_tree(n.path("/"))
        r = node_install(n, "install", "--runtime", "docker", "--driver-root", HOST_ROOT)
        assert r.returncode == 0, r.stdout + r.stderr
        n.restart_dockerd()
        yield n
    finally:
        problems = n.close()
        assert not problems, problems
