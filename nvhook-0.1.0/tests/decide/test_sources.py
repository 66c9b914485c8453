"""pipeline.decide(source, host, options): one decision for every front door, on the 8-GPU
fixture host. The NRI door's container (no bundle, no readable image yet) must get the GPUs,
nodes and rules the hook would give the same container from its bundle, with the libraries
where a CDI spec puts them; doctor's `explain` must report what the hook refuses, with the
facts known by then."""

from __future__ import annotations

import json

import pytest
from hostfix import bundle, config_dict, fx, private_dir  # noqa: F401

from nvhook.base.errors import HookError
from nvhook.base.log import EventLog
from nvhook.decide import cdimodel
from nvhook.decide.sources import Host, NriContainer, OciBundle, Options
from nvhook.start import pipeline

ENV = ["NVIDIA_VISIBLE_DEVICES=1,3", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]


@pytest.fixture
def host(fx, tmp_path):
    return Host(str(fx / "host-gpu8"), config_dict(private_dir(tmp_path / "cache")), EventLog("error"))


def _nri(env: list[str], **kw) -> NriContainer:
    return NriContainer("nri-c", dict(e.split("=", 1) for e in env), [], {}, [], **kw)


def test_an_nri_container_gets_the_hooks_devices_and_the_specs_library_dirs(fx, tmp_path, host):
    b = bundle(tmp_path / "b", fx.resolve() / "container-rhel", ENV)
    by_hook = pipeline.decide(OciBundle("c", None, str(b)), host).plan
    decision = pipeline.decide(_nri(ENV), host)
    by_nri = decision.plan
    assert [g["index"] for g in by_nri["gpus"]] == [g["index"] for g in by_hook["gpus"]] == [1, 3]
    assert by_nri["devices_cgroup"] == by_hook["devices_cgroup"]
    assert [m["target"] for m in by_nri["mounts"] if m["kind"] == "device"] == \
        [m["target"] for m in by_hook["mounts"] if m["kind"] == "device"]

    def libs(plan: dict) -> list[tuple[str, str]]:
        return sorted(tuple(m["target"].rsplit("/", 1)) for m in plan["mounts"] if m["kind"] == "library")

    # The same libraries: the hook's where the RHEL image's loader looks (it read the image),
    # the NRI container's, whose image is not readable yet, at their host directory, as a CDI
    # spec has them.
    libdir, _ = cdimodel.spec_libdirs(decision.facts["inventory"]["files"])
    assert libdir != "/usr/lib64"
    assert [name for _, name in libs(by_nri)] == [name for _, name in libs(by_hook)]
    assert {d for d, _ in libs(by_hook)} - {"/etc/OpenCL/vendors"} == {"/usr/lib64"}
    assert {d for d, _ in libs(by_nri)} - {"/etc/OpenCL/vendors"} == {libdir}
    assert decision.facts["bundle"]["config_path"] == "NRI container nri-c"
    assert json.loads(json.dumps(by_nri)) == by_nri


def test_a_container_that_asks_for_no_gpu_is_decided_without_the_host(host):
    decision = pipeline.decide(_nri(["PATH=/bin"]), host)
    assert decision.plan["mounts"] == [] and decision.facts["request"]["kind"] == "skip"
    assert "inventory" not in decision.facts


def test_explain_reports_the_refusal_decide_raises_with_the_facts_and_timings(fx, tmp_path, host):
    env = ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=99.0"]
    b = bundle(tmp_path / "b", fx / "container-debian", env)
    source = OciBundle("c", None, str(b))
    with pytest.raises(HookError) as raised:
        pipeline.decide(source, host)
    phases: dict = {}
    decision, refused = pipeline.explain(source, host, Options(change_host=False, phases=phases))
    assert refused == raised.value.message and refused.startswith("unsatisfied requirement NVIDIA_REQUIRE_CUDA")
    assert decision.facts["request"]["requirements"] == ["cuda>=99.0"]
    assert [g["index"] for g in decision.facts["selected"]] == [0]
    assert getattr(decision, "plan", None) is None  # no plan for a container that does not start
    # the caller's timings got what was timed before the refusal (the hook logs them)
    assert "discover_ms" in phases and decision.phases is phases

