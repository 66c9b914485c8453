"""deploy/kubernetes/ checked offline against the Kubernetes API's own types.

The `kubernetes` package's models are generated from the API's OpenAPI document: each field's
JSON name (attribute_map) and type (openapi_types). Every key of every manifest must be a field
of its type there, recursively, with a value of that type; then the package's own
deserialisation builds the objects, which fails on a missing required field. This catches what
`kubectl apply --dry-run=server` would reject for a misspelt or misplaced field, without a
cluster. It does not run admission (Pod Security, quotas): docs/kubernetes.md says what the
namespace needs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
client = pytest.importorskip("kubernetes.client")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
MANIFESTS = ["namespace.yaml", "daemonset.yaml", "daemonset-nri.yaml", "runtimeclass.yaml"]
PRIMITIVES = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}


def model_for(doc: dict):
    group_version, kind = doc["apiVersion"], doc["kind"]
    version = group_version.split("/")[-1]
    return getattr(client, f"{version.capitalize()}{kind}")


def check(value, type_name: str, where: str) -> list[str]:
    """Problems of `value` as the OpenAPI type `type_name` (the models' own notation)."""
    if type_name in PRIMITIVES:
        return [] if isinstance(value, PRIMITIVES[type_name]) and not (
            type_name == "int" and isinstance(value, bool)) else [f"{where}: {value!r} is not {type_name}"]
    m = re.fullmatch(r"[lL]ist\[(.+)\]", type_name)
    if m:
        if not isinstance(value, list):
            return [f"{where}: not a list"]
        return [p for i, v in enumerate(value) for p in check(v, m.group(1), f"{where}[{i}]")]
    m = re.fullmatch(r"dict\(str, (.+)\)|Dict\[str, (.+)\]", type_name)
    if m:
        if not isinstance(value, dict):
            return [f"{where}: not a map"]
        inner = m.group(1) or m.group(2)
        return [p for k, v in value.items() for p in check(v, inner, f"{where}.{k}")]
    cls = getattr(client, type_name)
    if not isinstance(value, dict):
        return [f"{where}: {type_name} must be an object"]
    by_json = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    problems = []
    for key, v in value.items():
        if key not in by_json:
            problems.append(f"{where}.{key}: no such field in {type_name}")
        else:
            problems += check(v, cls.openapi_types[by_json[key]], f"{where}.{key}")
    return problems


def docs() -> list[dict]:
    out = []
    for name in MANIFESTS:
        out += [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    return out


def test_every_manifest_is_valid_for_its_api_type():
    for doc in docs():
        cls = model_for(doc)
        assert check(doc, cls.__name__, doc["kind"]) == []
        built = client.ApiClient()._ApiClient__deserialize(doc, cls.__name__)  # required fields checked here
        assert built.kind == doc["kind"]


def test_the_checker_rejects_what_the_api_would():
    bad = yaml.safe_load((DEPLOY / "daemonset.yaml").read_text())
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["priviledged"] = True
    bad["spec"]["template"]["spec"]["tolerations"][0]["effect"] = ["NoSchedule"]
    problems = check(bad, "V1DaemonSet", "DaemonSet")
    assert problems == ["DaemonSet.spec.template.spec.tolerations[0].effect: ['NoSchedule'] is not str",
                        "DaemonSet.spec.template.spec.containers[0].securityContext.priviledged: no such field in "
                        "V1SecurityContext"]
    del bad["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        client.ApiClient()._ApiClient__deserialize(bad, "V1DaemonSet")


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "daemonset-nri.yaml"])
def test_the_daemonset_runs_node_install_as_the_rest_expects(manifest):
    from nvhook.commands.node import node
    from nvhook.commands.nodehost import parse_strategies

    ds = yaml.safe_load((DEPLOY / manifest).read_text())
    pod = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (c,) = pod["containers"]
    assert c["securityContext"]["privileged"] is True
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/host")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"] == "/" and mount["mountPropagation"] == "HostToContainer"
    assert c["command"][:3] == ["nvhook", "node", "install"]
    ctx = node.commands["install"].make_context("install", c["command"][3:])  # nvhook's own parser
    p = ctx.params
    assert p["host_root"] == "/host" and p["wait"] and p["ready_file"]
    assert p["nri"] is (manifest == "daemonset-nri.yaml") and p["restart_engine"]
    assert p["ready_file"] in shlex.join(c["readinessProbe"]["exec"]["command"])
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]

    runtime_class = yaml.safe_load((DEPLOY / "runtimeclass.yaml").read_text())
    assert runtime_class["handler"] == p["runtime_name"] == runtime_class["metadata"]["name"]
    strategy = ",".join(parse_strategies(p["strategies"]))  # the device plugin's own spelling of a list
    plugin = yaml.safe_load((DEPLOY / "device-plugin-values.yaml").read_text())
    assert plugin["deviceListStrategy"] == strategy and plugin["runtimeClassName"] == p["runtime_name"]
    operator = yaml.safe_load((DEPLOY / "gpu-operator-values.yaml").read_text())
    assert operator["toolkit"]["enabled"] is False and operator["cdi"]["enabled"] is False
    env = {e["name"]: e["value"] for e in operator["devicePlugin"]["env"]}
    assert env["DEVICE_LIST_STRATEGY"] == strategy
    namespace = yaml.safe_load((DEPLOY / "namespace.yaml").read_text())
    assert ds["metadata"]["namespace"] == namespace["metadata"]["name"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def project_version() -> str:
    from nvhook.base import tomlread

    return tomlread.loads((DEPLOY.parent.parent / "pyproject.toml").read_text())["project"]["version"]


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "daemonset-nri.yaml"])
def test_the_daemonset_pins_this_release_and_mounts_no_token(manifest):
    """A `:latest` tag with IfNotPresent keeps a node on whatever image it pulled first (the
    upgrade docs/kubernetes.md describes could not work); a privileged pod with the node's root
    has no use for an API token."""
    import nvhook

    ds = yaml.safe_load((DEPLOY / manifest).read_text())
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    version = project_version()
    assert version == nvhook.__version__
    assert c["image"] == f"localhost/nvhook-node:{version}"
    assert pod["automountServiceAccountToken"] is False
    assert c["securityContext"]["privileged"] is True  # the reason the token must stay out


def test_the_image_builder_tags_what_the_daemonsets_name():
    """build-oci.py's default tag is the one the manifests pull, and the docs' upgrade step
    names a new tag (a re-used one never reaches a node that has the old image)."""
    import subprocess
    import sys

    ds = yaml.safe_load((DEPLOY / "daemonset.yaml").read_text())
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    builder = DEPLOY.parent / "image" / "build-oci.py"
    r = subprocess.run([sys.executable, "-I", str(builder), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"[default: {c['image']}]" in " ".join(r.stdout.split())
    text = (DEPLOY.parent.parent / "docs" / "kubernetes.md").read_text()
    upgrading = text.split("## Upgrading", 1)[1].split("\n## ", 1)[0]
    assert "set image daemonset/nvhook-node nvhook=localhost/nvhook-node:NEW" in upgrading
    assert "Re-using a tag does neither" in upgrading and "nvhook-node:latest" not in text
    assert c["image"].split(":")[-1] != "latest"
