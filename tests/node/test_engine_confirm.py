"""Docker's own word on nvhook's daemon.json edit, on both roots (Docker 26 and 28.5):
`nvhook runtime configure --runtime docker` in the node asks the node's `dockerd --validate
--config-file` and says "confirmed" only when it accepts (an edit it refuses is put back byte for
byte with one line); a daemon.json dockerd refuses as it is gets nothing written.
(containerd's: test_containerd_shapes.py.)"""

from __future__ import annotations

from node import NVHOOK, NVHOOK_RUNTIME

DAEMON_JSON = '{\n  "log-level": "info",\n  "features": {"cdi": true}\n}\n'


def _configure(node, name: str, *args: str):
    node.run(["mkdir", "-p", "/etc/docker/confirm"])
    return node.run([NVHOOK, "runtime", "configure", "--runtime", "docker", "--config",
                     f"/etc/docker/confirm/{name}", "--runtime-path", NVHOOK_RUNTIME,
                     "--record", f"/run/nvhook-test/confirm-{name}.json", *args], check=False)


def test_dockerd_confirms_the_runtime(node):
    node.write("/etc/docker/confirm/ok.json", DAEMON_JSON)
    r = _configure(node, "ok.json", "--set-as-default")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "docker: confirmed: docker reads it as written (`dockerd --validate`)" in r.stdout, r.stdout
    v = node.run(["dockerd", "--validate", "--config-file", "/etc/docker/confirm/ok.json"], check=False)
    assert v.returncode == 0 and "configuration OK" in v.stdout + v.stderr


def test_a_daemon_json_dockerd_refuses_is_left_as_it_is(node):
    """A daemon.json with a key dockerd does not know (a typo): dockerd would not start with it,
    before nvhook or after. nvhook writes nothing and passes on dockerd's own complaint."""
    bad = '{\n  "log-levle": "info"\n}\n'
    node.write("/etc/docker/confirm/bad.json", bad, 0o640)
    r = _configure(node, "bad.json")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("nvhook: the dockerd here does not accept /etc/docker/confirm/bad.json as it is ("), \
        r.stderr
    assert "log-levle" in r.stderr and "nothing written" in r.stderr
    assert node.read("/etc/docker/confirm/bad.json") == bad
    assert oct(node.path("/etc/docker/confirm/bad.json").stat().st_mode & 0o777) == oct(0o640)
    assert not node.path("/run/nvhook-test/confirm-bad.json.json").exists()
