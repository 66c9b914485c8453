"""nvhook's hand-written NRI codec against protobuf's own: every field base/nrischema.py names
is checked against the descriptor protoc makes of the .proto (tests/nri/nri_api.proto, NRI's
names and numbers), and generated messages round-trip both ways: encoded by protobuf's
generated code and decoded by nvhook (base/nrimessages.py, what every handler of the plugin
gets), and encoded by nvhook (the adjustment, the registration, ttrpc's envelope) and decoded by
protobuf."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "nri"))
pytest.importorskip("grpc_tools")
hypothesis = pytest.importorskip("hypothesis")
import fakeruntime as fr  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nvhook.base import nrimessages as msgs  # noqa: E402
from nvhook.base import nrischema  # noqa: E402
from nvhook.start.nri import ttrpc  # noqa: E402

# The .proto names of the schema's two stand-ins.
OPTIONALS = ("OptionalInt64", "OptionalUInt32", "OptionalFileMode")


def descriptor_fields(desc) -> dict[str, int]:
    return {f.name.lower(): f.number for f in desc.fields}


@pytest.mark.parametrize("name", sorted(nrischema.MESSAGES))
def test_every_schema_field_is_the_protos(name):
    p = fr.pb()
    ours = nrischema.fields(nrischema.MESSAGES[name])
    assert ours, f"{name} names no field"
    if name == "OptionalValue":
        descs = [getattr(p, n).DESCRIPTOR for n in OPTIONALS]
    elif name == "MapEntry":
        descs = [p.PodSandbox.DESCRIPTOR.fields_by_name["annotations"].message_type,
                 p.Container.DESCRIPTOR.fields_by_name["annotations"].message_type]
    else:
        descs = [getattr(p, name).DESCRIPTOR]
    for desc in descs:
        theirs = descriptor_fields(desc)
        assert {k: theirs.get(k) for k in ours} == ours, (desc.full_name, ours, theirs)


def test_the_schema_names_every_field_the_plugin_decodes():
    """The typed objects' fields come from the schema: a Container field read by the plugin has
    a schema name (no number outside base/nrischema.py: tests/test_layers.py checks the code)."""
    assert set(nrischema.fields(nrischema.Container)) >= {"id", "pod_sandbox_id", "name", "state", "annotations",
                                                         "env", "mounts", "linux", "pid"}


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
uint32 = st.integers(0, 2**32 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def containers(draw):
    p = fr.pb()
    env = draw(st.lists(st.one_of(text, st.builds(lambda k, v: f"{k}={v}", text, text)), max_size=6))
    mounts = [p.Mount(destination=d, type=t, source=s, options=o)
              for d, t, s, o in draw(st.lists(st.tuples(text, text, text, st.lists(text, max_size=3)), max_size=4))]
    devices = [p.LinuxDevice(path=a, type=b, major=c, minor=d)
               for a, b, c, d in draw(st.lists(st.tuples(text, text, int64, int64), max_size=4))]
    return p.Container(id=draw(text), pod_sandbox_id=draw(text), name=draw(text), state=draw(st.integers(0, 4)),
                       annotations=draw(st.dictionaries(text, text, max_size=4)), args=draw(st.lists(text, max_size=3)),
                       env=env, mounts=mounts, linux=p.LinuxContainer(devices=devices), pid=draw(uint32))


@st.composite
def pods(draw):
    return fr.pb().PodSandbox(id=draw(text), name=draw(text), uid=draw(text), namespace=draw(text),
                              labels=draw(st.dictionaries(text, text, max_size=3)),
                              annotations=draw(st.dictionaries(text, text, max_size=4)),
                              runtime_handler=draw(text))


def expect_container(c) -> msgs.Container:
    env: dict[str, str] = {}
    for item in c.env:
        k, sep, v = item.partition("=")
        if sep and k:
            env[k] = v
    return msgs.Container(id=c.id, pod_sandbox_id=c.pod_sandbox_id, name=c.name, state=c.state,
                          annotations=dict(c.annotations), env=env,
                          mounts=[msgs.Mount(m.destination, m.source) for m in c.mounts],
                          devices=[msgs.Device(d.path, d.type, d.major, d.minor) for d in c.linux.devices], pid=c.pid)


def expect_pod(p) -> msgs.Pod:
    return msgs.Pod(id=p.id, name=p.name, namespace=p.namespace, annotations=dict(p.annotations),
                    runtime_handler=p.runtime_handler)


@settings(max_examples=150, deadline=None)
@given(pods(), containers(), st.integers(0, 10))
def test_requests_encoded_by_protobuf_decode_the_same_in_nvhook(pod, c, event):
    p = fr.pb()
    got = msgs.create_container(p.CreateContainerRequest(pod=pod, container=c).SerializeToString())
    assert got == msgs.CreateContainer(expect_pod(pod), expect_container(c))
    got_sc = msgs.state_change(p.StateChangeEvent(event=event, pod=pod, container=c).SerializeToString())
    assert got_sc == msgs.StateChange(event, expect_pod(pod), expect_container(c))
    sync = msgs.synchronize(p.SynchronizeRequest(pods=[pod, pod], containers=[c]).SerializeToString())
    assert sync == msgs.Synchronize([expect_pod(pod)] * 2, [expect_container(c)])


@settings(max_examples=50, deadline=None)
@given(text, text, int64)
def test_configure_encoded_by_protobuf_decodes_the_same(name, version, timeout):
    raw = fr.pb().ConfigureRequest(runtime_name=name, runtime_version=version, request_timeout=timeout)
    assert msgs.configure(raw.SerializeToString()) == msgs.Configure(name, version, timeout)


nodes = st.fixed_dictionaries({"path": text, "type": text, "major": st.integers(0, 2**31), "minor": st.integers(0, 2**31),
                               "file_mode": st.one_of(st.none(), st.integers(0, 0o7777)),
                               "uid": st.one_of(st.none(), uint32), "gid": st.one_of(st.none(), uint32)})
rules = st.fixed_dictionaries({"allow": st.booleans(), "type": text, "access": text,
                               "major": st.one_of(st.none(), int64), "minor": st.one_of(st.none(), int64)})
binds = st.fixed_dictionaries({"container_path": text, "host_path": text, "options": st.lists(text, max_size=3)})


@settings(max_examples=150, deadline=None)
@given(st.lists(nodes, max_size=3), st.lists(rules, max_size=3), st.lists(binds, max_size=3),
       st.lists(st.builds(lambda k, v: f"{k}={v}", text, text), max_size=3),
       st.one_of(st.none(), st.fixed_dictionaries({"path": text, "args": st.lists(text, max_size=3),
                                                   "env": st.lists(text, max_size=2)})),
       st.lists(text, max_size=2))
def test_the_adjustment_nvhook_encodes_is_what_protobuf_decodes(nodes, rules, mounts, env, hook, cdi):
    from nvhook.apply import nriadjust

    p = fr.pb()
    edits = {"device_nodes": nodes, "cgroup_devices": rules, "env": env}
    raw = nriadjust.create_response(nriadjust.adjustment(edits, mounts, hook, cdi))
    adj = p.CreateContainerResponse.FromString(raw).adjust
    assert [(d.path, d.type, d.major, d.minor) for d in adj.linux.devices] == \
        [(n["path"], n["type"], n["major"], n["minor"]) for n in nodes]
    for d, n in zip(adj.linux.devices, nodes):
        for key in ("file_mode", "uid", "gid"):
            assert d.HasField(key) == (n[key] is not None) and getattr(d, key).value == (n[key] or 0)
    assert [(r.allow, r.type, r.access, r.major.value if r.HasField("major") else None,
             r.minor.value if r.HasField("minor") else None) for r in adj.linux.resources.devices] == \
        [(r["allow"], r["type"], r["access"], r["major"], r["minor"]) for r in rules]
    assert [(m.destination, m.type, m.source, list(m.options)) for m in adj.mounts] == \
        [(m["container_path"], "bind", m["host_path"], m["options"]) for m in mounts]
    assert [f"{kv.key}={kv.value}" for kv in adj.env] == env
    assert [(h.path, list(h.args), list(h.env)) for h in adj.hooks.create_container] == \
        ([(hook["path"], hook["args"], hook["env"])] if hook else [])
    assert [d.name for d in adj.CDI_devices] == cdi


@settings(max_examples=50, deadline=None)
@given(text, text, text, text, st.binary(max_size=64), st.integers(0, 16), text, st.floats(0.001, 100))
def test_the_envelope_and_registration_nvhook_encodes_are_protobufs(name, index, service, method, payload, code,
                                                                     error, timeout):
    import socket

    p = fr.pb()
    reg = p.RegisterPluginRequest.FromString(msgs.register_plugin(name, index))
    assert (reg.plugin_name, reg.plugin_idx) == (name, index)
    assert p.ConfigureResponse.FromString(msgs.configure_response(code)).events == code
    a, b = socket.socketpair()
    try:
        mux = ttrpc.Mux(a)
        mux.call(service, method, payload, timeout_s=timeout)
        rt = fr.Runtime(b)
        _stream, _typ, body = rt.read(2)
        req = p.TtrpcRequest.FromString(body)
        assert (req.service, req.method, req.payload, req.timeout_nano) == (service, method, payload,
                                                                          int(timeout * 1e9))
        assert ttrpc.parse_request(body) == (service, method, payload)
        mux.reply(ttrpc.Message(1, 3, ttrpc.TYPE_REQUEST, 0, b""), payload, code=code, error=error)
        _stream, _typ, body = rt.read(1)
        resp = p.TtrpcResponse.FromString(body)
        assert (resp.status.code, resp.status.message if code else "", resp.payload) == (code, error if code else "",
                                                                                         payload)
        assert ttrpc.parse_response(body) == (code, error if code else "", payload)
    finally:
        a.close()
        b.close()


def test_no_field_number_outside_the_schema():
    """Every codec call in the plugin's modules names its field (base/nrischema.py): a bare number
    (`pb.string(c, 8)`) anywhere else is a field the schema test above does not check."""
    import re

    import nvhook

    pkg = Path(nvhook.__file__).resolve().parent
    files = [*sorted((pkg / "start/nri").glob("*.py")), pkg / "apply/nriadjust.py", pkg / "base/nrimessages.py"]
    call = re.compile(r"\bpb\.\w+\([^()]*?,\s*\d+\s*[,)]")
    bare = [f"{f.name}:{n}: {line.strip()}" for f in files
            for n, line in enumerate(f.read_text().splitlines(), 1) if call.search(line)]
    assert not bare, bare
    assert call.search("pb.put_string(out, 1, name)") and not call.search("pb.put_string(out, f.path, n)")
