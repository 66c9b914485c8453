"""The request rules, case by case, against the facts of NVIDIA's own table tests
(nvidia-container-toolkit: container_config_test.go, cuda_image_test.go,
capabilities_test.go; libnvidia-container's device and MIG selection). No I/O.

Each case is named for what it proves. `NVIDIA` says whether nvhook agrees with NVIDIA's hook
there ("same") or differs on purpose ("differs: ..."), the table in
docs/request-rules.md, "Request rules: where nvhook differs from NVIDIA", lists every difference with its reason.
The cases are written for nvhook, from those facts; no NVIDIA code or text is copied.
"""

from __future__ import annotations

import copy

import pytest

from nvhook.base import config
from nvhook.base.catalog import CAPABILITIES
from nvhook.base.errors import HookError
from nvhook.decide import request
from nvhook.observe import oci

ALL_CAPS = list(CAPABILITIES)
DEFAULT = ["utility", "compute"]
ROOT = "/var/run/nvidia-container-devices"


def cfg(devices: dict | None = None, req: dict | None = None) -> dict:
    c = copy.deepcopy(config.DEFAULTS)
    c["devices"].update(devices or {})
    c["request"].update(req or {})
    return c


def vol(*names: str, source: str = "/dev/null", root: str = ROOT) -> list[dict]:
    return [{"destination": f"{root}/{n}" if n else root, "source": source} for n in names]


def parse(env: dict, privileged: bool = False, mounts: list | None = None, c: dict | None = None) -> dict:
    return request.parse(env, privileged=privileged, mounts=mounts or [], config=c or cfg())


# (name, env, options, expected subset of the request or ("error", substring), NVIDIA)
# options: privileged, mounts, devices (config [devices]), req (config [request])
CASES = [
    # -- which containers are GPU containers (container_config_test.go) ------------------------
    ("no_env_unprivileged_is_not_a_gpu_container", {}, {}, {"kind": "skip"}, "same"),
    ("no_env_privileged_is_not_a_gpu_container", {}, {"privileged": True}, {"kind": "skip"}, "same"),
    ("legacy_image_implies_all_gpus_all_capabilities_and_cuda_requirement", {"CUDA_VERSION": "9.0"}, {},
     {"kind": "devices", "devices": ["all"], "capabilities": ALL_CAPS, "requirements": ["cuda>=9.0"]}, "same"),
    ("legacy_image_with_devices_all", {"CUDA_VERSION": "9.0", "NVIDIA_VISIBLE_DEVICES": "all"}, {},
     {"devices": ["all"], "capabilities": ALL_CAPS, "requirements": ["cuda>=9.0"]}, "same"),
    ("legacy_image_with_empty_devices_is_not_a_gpu_container",
     {"CUDA_VERSION": "9.0", "NVIDIA_VISIBLE_DEVICES": ""}, {}, {"kind": "skip"}, "same"),
    ("legacy_image_with_void_is_not_a_gpu_container",
     {"CUDA_VERSION": "9.0", "NVIDIA_VISIBLE_DEVICES": "void"}, {}, {"kind": "skip"}, "same"),
    ("legacy_image_with_none_gets_the_driver_with_every_capability",
     {"CUDA_VERSION": "9.0", "NVIDIA_VISIBLE_DEVICES": "none"}, {},
     {"kind": "none", "devices": [], "capabilities": ALL_CAPS, "requirements": ["cuda>=9.0"]}, "same"),
    ("legacy_image_with_ids_and_unset_capabilities_gets_every_capability",
     {"CUDA_VERSION": "9.0", "NVIDIA_VISIBLE_DEVICES": "gpu0,gpu1"}, {},
     {"devices": ["gpu0", "gpu1"], "capabilities": ALL_CAPS}, "same"),
    ("legacy_image_with_empty_capabilities_gets_the_default",
     {"CUDA_VERSION": "9.0", "NVIDIA_VISIBLE_DEVICES": "gpu0", "NVIDIA_DRIVER_CAPABILITIES": ""}, {},
     {"capabilities": DEFAULT}, "same"),
    ("legacy_image_with_capabilities_all", {"CUDA_VERSION": "9.0", "NVIDIA_DRIVER_CAPABILITIES": "all"}, {},
     {"capabilities": ALL_CAPS}, "same"),
    ("legacy_image_with_named_capabilities", {"CUDA_VERSION": "9.0", "NVIDIA_DRIVER_CAPABILITIES": "video,display"},
     {}, {"capabilities": ["video", "display"]}, "same"),
    ("legacy_image_requirements_are_collected_with_its_cuda_version",
     {"CUDA_VERSION": "9.0", "NVIDIA_REQUIRE_REQ0": "driver>=400", "NVIDIA_REQUIRE_REQ1": "arch>=5.0"}, {},
     {"requirements": ["driver>=400", "arch>=5.0", "cuda>=9.0"],
      "requirement_sources": ["NVIDIA_REQUIRE_REQ0", "NVIDIA_REQUIRE_REQ1", "CUDA_VERSION"]}, "same"),
    ("legacy_image_disable_require_drops_every_requirement",
     {"CUDA_VERSION": "9.0", "NVIDIA_REQUIRE_REQ0": "driver>=400", "NVIDIA_DISABLE_REQUIRE": "true"}, {},
     {"requirements": []}, "same"),
    ("cuda_version_with_require_cuda_is_not_legacy", {"CUDA_VERSION": "9.0", "NVIDIA_REQUIRE_CUDA": "cuda>=9.0"}, {},
     {"kind": "skip"}, "same"),
    ("require_cuda_alone_is_not_a_gpu_container", {"NVIDIA_REQUIRE_CUDA": "cuda>=9.0"}, {}, {"kind": "skip"}, "same"),
    ("empty_cuda_version_is_not_legacy", {"CUDA_VERSION": ""}, {}, {"kind": "skip"}, "same"),
    ("empty_require_cuda_leaves_the_image_legacy", {"CUDA_VERSION": "11.0", "NVIDIA_REQUIRE_CUDA": ""}, {},
     {"devices": ["all"], "requirements": ["cuda>=11.0"]}, "same"),
    ("modern_image_all_gets_default_capabilities", {"NVIDIA_VISIBLE_DEVICES": "all"}, {},
     {"devices": ["all"], "capabilities": DEFAULT, "requirements": []}, "same"),
    ("modern_image_requirements", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=9.0"}, {},
     {"requirements": ["cuda>=9.0"]}, "same"),
    # -- keywords and ids (devices.go; libnvidia-container select_devices) --------------------
    ("all_is_case_insensitive", {"NVIDIA_VISIBLE_DEVICES": "ALL"}, {}, {"devices": ["all"]}, "same"),
    ("all_beside_ids_is_all", {"NVIDIA_VISIBLE_DEVICES": "0,All,3"}, {}, {"devices": ["all"]}, "same"),
    ("void_beside_ids_is_nothing", {"NVIDIA_VISIBLE_DEVICES": "0,void"}, {}, {"kind": "skip"}, "same"),
    ("void_is_case_insensitive", {"NVIDIA_VISIBLE_DEVICES": "VOID"}, {}, {"kind": "skip"},
     "differs: NVIDIA's hook passes VOID on as a device id"),
    ("none_is_case_insensitive", {"NVIDIA_VISIBLE_DEVICES": "None"}, {}, {"kind": "none"},
     "differs: NVIDIA's hook passes None on as a device id"),
    ("none_beside_ids_is_refused", {"NVIDIA_VISIBLE_DEVICES": "none,0"}, {}, ("error", "'none' cannot be combined"),
     "differs: NVIDIA gives no GPU or every GPU depending on the order"),
    ("only_commas_is_nothing", {"NVIDIA_VISIBLE_DEVICES": ",,"}, {}, {"kind": "skip"}, "same"),
    ("ids_are_trimmed_and_deduplicated", {"NVIDIA_VISIBLE_DEVICES": " 0, GPU-a ,0,MIG-x, 1:2 "}, {},
     {"devices": ["0", "GPU-a", "MIG-x", "1:2"]}, "same"),
    # -- capabilities (capabilities_test.go, getDriverCapabilities) ----------------------------
    ("unknown_capability_is_refused", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,gaming"},
     {}, ("error", "unknown capability 'gaming'"), "same"),
    ("capability_names_ignore_case", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "Video, UTILITY"},
     {}, {"capabilities": ["video", "utility"]}, "differs: NVIDIA refuses Video"),
    ("empty_capability_entries_are_skipped", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": ",compute,"},
     {}, {"capabilities": ["compute"]}, "same"),
    ("supported_capabilities_narrow_all", {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "all"},
     {"req": {"supported_driver_capabilities": "video,display"}}, {"capabilities": ["video", "display"]}, "same"),
    ("supported_capabilities_allow_what_they_list",
     {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "video,display"},
     {"req": {"supported_driver_capabilities": "video,display,compute,utility"}},
     {"capabilities": ["video", "display"]}, "same"),
    ("supported_capabilities_keep_the_default", {"NVIDIA_VISIBLE_DEVICES": "all"},
     {"req": {"supported_driver_capabilities": "video,display,utility,compute"}}, {"capabilities": DEFAULT}, "same"),
    ("supported_capabilities_narrow_the_default", {"NVIDIA_VISIBLE_DEVICES": "all"},
     {"req": {"supported_driver_capabilities": "compute"}}, {"capabilities": ["compute"]}, "same"),
    ("supported_capabilities_narrow_a_legacy_images_all", {"CUDA_VERSION": "12.0"},
     {"req": {"supported_driver_capabilities": "compute,utility,video"}},
     {"capabilities": ["compute", "utility", "video"]}, "same"),
    ("unsupported_capability_is_refused",
     {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
     {"req": {"supported_driver_capabilities": "graphics"}}, ("error", "'compute' in NVIDIA_DRIVER_CAPABILITIES"),
     "same"),
    # -- swarm resource (container_config_test.go, cuda_image_test.go) -------------------------
    ("swarm_resource_overrides_visible_devices", {"NVIDIA_VISIBLE_DEVICES": "all", "DOCKER_RESOURCE_GPU": "GPU1,GPU2"},
     {"req": {"swarm_resource": "DOCKER_RESOURCE_GPU"}, "privileged": True},
     {"devices": ["GPU1", "GPU2"], "devices_source": "DOCKER_RESOURCE_GPU"}, "same"),
    ("swarm_resource_list_uses_the_variables_that_are_set",
     {"NVIDIA_VISIBLE_DEVICES": "all", "DOCKER_SWARM_RESOURCE": "GPU1,GPU2"},
     {"req": {"swarm_resource": "NOT_DOCKER_SWARM_RESOURCE, DOCKER_SWARM_RESOURCE"}}, {"devices": ["GPU1", "GPU2"]},
     "same"),
    ("swarm_resource_variables_are_concatenated",
     {"NVIDIA_VISIBLE_DEVICES": "GPU-1", "DOCKER_RESOURCE_GPUS": "MIG-3", "DOCKER_RESOURCE_GPUS_ADDITIONAL": "GPU-6"},
     {"req": {"swarm_resource": "DOCKER_RESOURCE_GPUS,DOCKER_RESOURCE_GPUS_ADDITIONAL"}},
     {"devices": ["MIG-3", "GPU-6"]}, "same"),
    ("swarm_resource_unset_falls_back_to_visible_devices", {"NVIDIA_VISIBLE_DEVICES": "GPU-1"},
     {"req": {"swarm_resource": "DOCKER_RESOURCE_GPU"}}, {"devices": ["GPU-1"]}, "same"),
    ("swarm_resource_void_is_nothing", {"DOCKER_RESOURCE_GPU": "void"},
     {"req": {"swarm_resource": "DOCKER_RESOURCE_GPU"}},
     {"kind": "skip"}, "same"),
    ("swarm_resource_none_is_the_driver_only", {"DOCKER_RESOURCE_GPU": "none"},
     {"req": {"swarm_resource": "DOCKER_RESOURCE_GPU"}}, {"kind": "none"}, "same"),
    ("swarm_resource_is_an_env_request_the_policy_refuses", {"DOCKER_RESOURCE_GPU": "GPU-1"},
     {"req": {"swarm_resource": "DOCKER_RESOURCE_GPU"}, "devices": {"accept_envvar_unprivileged": False}},
     {"kind": "skip"}, "same"),
    ("swarm_resource_off_by_default", {"DOCKER_RESOURCE_GPU": "GPU-1"}, {}, {"kind": "skip"}, "same"),
    # -- volume mounts (cuda_image_test.go TestGetVisibleDevicesFromMounts / VisibleDevices) ---
    ("volume_mount_not_from_dev_null_is_no_request", {}, {"mounts": vol("GPU0", source="/not/dev/null"),
                                                          "devices": {"accept_volume_mounts": True}},
     {"kind": "skip"}, "same"),
    ("volume_mount_outside_the_root_is_no_request", {}, {"mounts": vol("GPU0", root="/other/prefix"),
                                                         "devices": {"accept_volume_mounts": True}},
     {"kind": "skip"}, "same"),
    ("volume_mount_of_the_root_itself_is_no_request", {},
     {"mounts": vol(""), "devices": {"accept_volume_mounts": True}},
     {"kind": "skip"}, "same"),
    ("volume_mounts_keep_slashes_in_names", {}, {"mounts": vol("GPU0-MIG0/0/1", "GPU1-MIG0/0/1"),
                                                 "devices": {"accept_volume_mounts": True}},
     {"devices": ["GPU0-MIG0/0/1", "GPU1-MIG0/0/1"]}, "same"),
    ("volume_mount_imex_entries_are_not_devices", {}, {"mounts": vol("GPU0", "imex/0", "GPU1"),
                                                       "devices": {"accept_volume_mounts": True}},
     {"devices": ["GPU0", "GPU1"], "imex": ["0"], "imex_source": "volume-mounts"}, "same"),
    ("volume_mounts_win_for_unprivileged_containers_under_the_policy", {"NVIDIA_VISIBLE_DEVICES": "GPU2,GPU3"},
     {"mounts": vol("GPU0", "GPU1"), "devices": {"accept_volume_mounts": True, "accept_envvar_unprivileged": False}},
     {"devices": ["GPU0", "GPU1"]}, "same"),
    ("no_volume_mounts_env_refused_under_the_policy", {"NVIDIA_VISIBLE_DEVICES": "GPU0,GPU1"},
     {"devices": {"accept_volume_mounts": True, "accept_envvar_unprivileged": False}}, {"kind": "skip"}, "same"),
    ("no_volume_mounts_env_honoured_when_privileged", {"NVIDIA_VISIBLE_DEVICES": "GPU0,GPU1"},
     {"privileged": True, "devices": {"accept_volume_mounts": True, "accept_envvar_unprivileged": False}},
     {"devices": ["GPU0", "GPU1"]}, "same"),
    ("volume_mounts_ignored_when_not_accepted", {"NVIDIA_VISIBLE_DEVICES": "GPU2,GPU3"},
     {"mounts": vol("GPU0", "GPU1")}, {"devices": ["GPU2", "GPU3"]}, "same"),
    ("volume_mounts_not_accepted_and_env_refused_is_nothing", {"NVIDIA_VISIBLE_DEVICES": "GPU2,GPU3"},
     {"mounts": vol("GPU0"), "devices": {"accept_envvar_unprivileged": False}}, {"kind": "skip"}, "same"),
    ("duplicate_volume_mounts_count_once", {},
     {"mounts": vol("GPU0", "GPU0"), "devices": {"accept_volume_mounts": True}},
     {"devices": ["GPU0"]}, "same"),
    # -- the legacy image's implied `all` under the policy (issue 14, bypass 1) ----------------
    ("legacy_all_is_refused_for_unprivileged_containers_under_the_policy", {"CUDA_VERSION": "11.8"},
     {"devices": {"accept_envvar_unprivileged": False}}, {"kind": "skip"}, "same"),
    ("legacy_all_is_honoured_for_privileged_containers_under_the_policy", {"CUDA_VERSION": "11.8"},
     {"privileged": True, "devices": {"accept_envvar_unprivileged": False}}, {"devices": ["all"]}, "same"),
    # -- requirements (cuda_image_test.go TestGetRequirements) ---------------------------------
    ("jetpack_requirement_is_ignored", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_JETPACK": "csv-mounts=all"}, {},
     {"requirements": []}, "same"),
    ("jetpack_host_mounts_is_ignored",
     {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_JETPACK_HOST_MOUNTS": "base-only"},
     {}, {"requirements": []}, "same"),
    ("requirements_are_concatenated", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=11.6",
                                       "NVIDIA_REQUIRE_BRAND": "brand=tesla"}, {},
     {"requirements": ["brand=tesla", "cuda>=11.6"]}, "same"),
    ("legacy_cuda_version_v_prefix_is_a_version", {"CUDA_VERSION": "v11.6"}, {}, {"requirements": ["cuda>=11.6"]},
     "same"),
    ("legacy_cuda_version_major_only_is_a_version", {"CUDA_VERSION": "8"}, {}, {"requirements": ["cuda>=8.0"]}, "same"),
    ("legacy_invalid_cuda_version_refuses_the_container", {"CUDA_VERSION": "legacy"}, {},
     ("error", "CUDA_VERSION='legacy' is not a version"), "same"),
    ("legacy_invalid_cuda_version_is_fine_when_requirements_are_disabled",
     {"CUDA_VERSION": "11.x", "NVIDIA_DISABLE_REQUIRE": "1"}, {}, {"devices": ["all"], "requirements": []}, "same"),
    ("admin_disable_require_drops_every_requirement", {"CUDA_VERSION": "11.x", "NVIDIA_REQUIRE_CUDA2": "cuda>=99"},
     {"req": {"disable_require": True}}, {"requirements": []}, "same"),
    # -- MIG management (container_config_test.go; libnvidia-container select_mig_*_devices) ----
    ("mig_config_all_privileged", {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "all"},
     {"privileged": True}, {"mig_config": True, "mig_monitor": False}, "same"),
    ("mig_config_unprivileged_is_refused", {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "all"}, {},
     ("error", "not privileged"), "same"),
    ("mig_config_ids_are_refused", {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "mig0,mig1"},
     {"privileged": True}, ("error", "only 'all'"), "same"),
    ("mig_monitor_all_is_case_insensitive_and_skips_empty_entries",
     {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_MIG_MONITOR_DEVICES": ",ALL"}, {"privileged": True},
     {"mig_monitor": True}, "same"),
    ("mig_monitor_unprivileged_is_refused", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_MIG_MONITOR_DEVICES": "all"}, {},
     ("error", "not privileged"), "same"),
    ("mig_monitor_empty_is_unset", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_MIG_MONITOR_DEVICES": ""}, {},
     {"mig_monitor": False}, "same"),
    # -- IMEX channels (cuda_image_test.go TestImexChannelsFromEnvVar, ImexChannelRequests) -----
    ("imex_channels_from_env", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "3,4"}, {},
     {"imex": ["3", "4"], "imex_source": "NVIDIA_IMEX_CHANNELS"}, "same"),
    ("legacy_image_gets_no_imex_channel_by_default", {"CUDA_VERSION": "1.2.3"}, {}, {"imex": []}, "same"),
    ("imex_all_from_env_is_not_honoured", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "all"}, {},
     {"imex": []}, "same"),
    ("imex_env_refused_under_the_policy", {"NVIDIA_IMEX_CHANNELS": "3"},
     {"mounts": vol("0"), "devices": {"accept_volume_mounts": True, "accept_envvar_unprivileged": False}},
     {"devices": ["0"], "imex": []}, "same"),
    ("imex_volume_mounts_win_over_env", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "5"},
     {"mounts": vol("imex/1"), "devices": {"accept_volume_mounts": True}}, {"imex": ["1"]}, "same"),
    ("ignore_imex_channel_requests_drops_both", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "5"},
     {"mounts": vol("imex/1"), "devices": {"accept_volume_mounts": True},
      "req": {"ignore_imex_channel_requests": True}}, {"imex": []}, "same"),
    ("imex_void_is_no_channel", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "void"}, {}, {"imex": []},
     "same"),
    ("imex_channel_must_be_a_number", {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_IMEX_CHANNELS": "-1"}, {},
     ("error", "IMEX channel '-1'"), "differs: NVIDIA passes it to nvidia-container-cli, which fails later"),
]


@pytest.mark.parametrize("name,env,opts,expected,nvidia", CASES, ids=[c[0] for c in CASES])
def test_request_rule(name, env, opts, expected, nvidia):
    c = cfg(opts.get("devices"), opts.get("req"))
    if isinstance(expected, tuple):
        with pytest.raises(HookError, match=None) as e:
            parse(env, opts.get("privileged", False), opts.get("mounts"), c)
        assert expected[1] in str(e.value) and "\n" not in str(e.value), name
        return
    r = parse(env, opts.get("privileged", False), opts.get("mounts"), c)
    for key, want in expected.items():
        assert r[key] == want, f"{name}: {key} = {r[key]!r}, want {want!r}"


def test_every_case_is_named_once_and_says_how_it_compares():
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names))
    assert all(c[4] == "same" or c[4].startswith("differs: ") for c in CASES)


# CUDA_VERSION as NVIDIA parses it (a semantic version; cuda_image_test.go's tables).
VALID_CUDA_VERSIONS = [("0", "0.0"), ("8", "8.0"), ("7.5", "7.5"), ("9.0.116", "9.0"),
                       ("4294967295.4294967295.4294967295", "4294967295.4294967295"), ("v11.6", "11.6"),
                       ("12.2.0-rc1", "12.2"), ("12.2.0+build.5", "12.2"), ("12.2-beta.1+x", "12.2")]
INVALID_CUDA_VERSIONS = ["foo", "foo.5.10", "9.0.116.50", "9.0.116foo", "7.foo", "9.0.bar", "9.4294967296",
                         "9.0.116.", "9..0", "9.", ".5.10", "-9", "+9", "-9.1.116", "-9.-1.-116", "09.1", "9.01",
                         "\u00b2.\u00b3", "12.2 ", " 12.2", "12.2.0-", "12.2.0-01", "12.2.0+", "V12.2", "1" * 300]


@pytest.mark.parametrize("version,major_minor", VALID_CUDA_VERSIONS, ids=[v for v, _ in VALID_CUDA_VERSIONS])
def test_cuda_version_is_major_minor(version, major_minor):
    assert request.cuda_major_minor(version) == major_minor


@pytest.mark.parametrize("version", INVALID_CUDA_VERSIONS, ids=[repr(v)[:20] for v in INVALID_CUDA_VERSIONS])
def test_cuda_version_that_is_not_a_version(version):
    assert request.cuda_major_minor(version) is None


# NVIDIA_DISABLE_REQUIRE as Go's strconv.ParseBool reads it.
TRUE = ["1", "t", "T", "TRUE", "true", "True"]
NOT_TRUE = ["0", "f", "F", "FALSE", "false", "False", "yes", "on", "y", " true", "true ", "tRUE", "", "2"]


@pytest.mark.parametrize("value", TRUE + NOT_TRUE, ids=[repr(v) for v in TRUE + NOT_TRUE])
def test_disable_require_is_go_parse_bool(value):
    r = parse({"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=11", "NVIDIA_DISABLE_REQUIRE": value})
    assert (r["requirements"] == []) == (value in TRUE)


# Whether the container is privileged: CAP_SYS_ADMIN in the bounding set; specs before
# runtime-spec 1.0.0-rc5 give process.capabilities as one plain array.
PRIVILEGE = [
    ("bounding_set_with_sys_admin", {"bounding": ["CAP_SYS_ADMIN"]}, True),
    ("effective_only_is_not_privileged", {"effective": ["CAP_SYS_ADMIN"], "bounding": []}, False),
    ("pre_1_0_plain_array_with_sys_admin", ["CAP_CHOWN", "CAP_SYS_ADMIN"], True),
    ("pre_1_0_plain_array_without_sys_admin", ["CAP_CHOWN"], False),
    ("no_capabilities", None, False),
    ("capabilities_of_the_wrong_type", "CAP_SYS_ADMIN", False),
]


@pytest.mark.parametrize("name,caps,privileged", PRIVILEGE, ids=[p[0] for p in PRIVILEGE])
def test_privileged_from_the_spec(name, caps, privileged):
    assert oci.is_privileged(caps) is privileged
