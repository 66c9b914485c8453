"""A CRI client that does what kubelet does to run a pod, for the node tests.

Why a small gRPC client from the CRI proto and not crictl: crictl is a Go program (cri-tools,
not packaged by Debian) whose build needs the Go module proxy, which this machine and CI do not
reach; and a test wants the protocol's own messages (the CDI_devices field, the exact mounts
kubelet sends, ContainerStatus as kubelet reads it) rather than crictl's JSON/YAML rendering of
them. tests/node/cri.proto (the runtime.v1 messages kubelet uses) is compiled with grpcio-tools
into a temporary directory when first needed; nothing generated is committed.

`Kubelet` (below) builds the requests the way kubelet does for a pod spec: the pod's cgroup
parent, host network (the node has no CNI), a DNS config, and for each container kubelet's
usual mounts (/etc/hosts, /dev/termination-log, the service account token volume) plus what
NVIDIA's device plugin answered for its GPUs (`DevicePlugin`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

PROTO = Path(__file__).resolve().parent / "cri.proto"
_pb = None


def pb():
    """The generated message module (runtime.v1), compiled once per process."""
    global _pb
    if _pb is None:
        from protogen import compiled

        _pb = compiled(PROTO, "cri")
    return _pb


class CRIError(Exception):
    """A CRI call that failed: `code` is the gRPC status name, `details` containerd's message."""

    def __init__(self, method: str, code: str, details: str):
        super().__init__(f"{method}: {code}: {details}")
        self.method, self.code, self.details = method, code, details


class CRI:
    """RuntimeService and ImageService over the unix socket `socket`. Each method takes the
    request message (or keyword fields for it) and returns the reply message; a failed call
    raises CRIError."""

    def __init__(self, socket: str, timeout: float = 120):
        import grpc

        self._grpc = grpc
        self.socket = socket
        self.timeout = timeout
        self.channel = grpc.insecure_channel(f"unix://{socket}")

    def close(self) -> None:
        self.channel.close()

    def call(self, service: str, method: str, request, timeout: float | None = None):
        reply_type = getattr(pb(), f"{method}Response")
        stub = self.channel.unary_unary(f"/runtime.v1.{service}/{method}",
                                        request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=reply_type.FromString)
        try:
            return stub(request, timeout=timeout or self.timeout)
        except self._grpc.RpcError as e:
            raise CRIError(method, e.code().name, e.details()) from None

    def __getattr__(self, method: str):
        if not method[:1].isupper():
            raise AttributeError(method)
        service = "ImageService" if method in ("ListImages",) else "RuntimeService"

        def rpc(request=None, timeout: float | None = None, **fields):
            req = request if request is not None else getattr(pb(), f"{method}Request")(**fields)
            return self.call(service, method, req, timeout)
        return rpc

    def wait_ready(self, timeout: float = 60) -> None:
        """Until the runtime answers Status with RuntimeReady (NetworkReady is not needed: every
        pod here is on the node's network)."""
        import time

        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                st = self.Status(timeout=5)
                conds = {c.type: c.status for c in st.status.conditions}
                if conds.get("RuntimeReady"):
                    return
                last = str(conds)
            except CRIError as e:
                last = str(e)
            time.sleep(0.2)
        raise AssertionError(f"CRI at {self.socket} not ready after {timeout}s: {last}")


# -- what NVIDIA's device plugin answers ---------------------------------------------------------

VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")


@dataclass
class Allocation:
    """One container's share of a device plugin's Allocate answer: what kubelet merges into its
    CreateContainer request."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # (container, host, readonly)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)


def device_plugin(strategy: str, ids: list[str], response_id: str | None = None) -> Allocation:
    """What k8s-device-plugin returns for GPUs `ids` (as its `deviceIDStrategy` names them:
    UUIDs, or indices like "0" and "1:0" for MIG) under `deviceListStrategy` `strategy`.
    envvar: NVIDIA_VISIBLE_DEVICES=<ids>; volume-mounts: /dev/null mounted read-only at
    <root>/<id> per device and NVIDIA_VISIBLE_DEVICES=<root>; cdi-annotations: one
    `cdi.k8s.io/nvidia-device-plugin_<response id>` annotation naming nvidia.com/gpu=<id> each;
    cdi-cri: the CRI CDI_devices field."""
    a = Allocation()
    if strategy == "envvar":
        a.envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(ids)
    elif strategy == "volume-mounts":
        a.envs["NVIDIA_VISIBLE_DEVICES"] = VOLUME_MOUNTS_ROOT
        a.mounts = [(f"{VOLUME_MOUNTS_ROOT}/{i}", "/dev/null", True) for i in ids]
    elif strategy == "cdi-annotations":
        rid = response_id or uuid.uuid4().hex
        a.annotations[f"cdi.k8s.io/nvidia-device-plugin_{rid}"] = ",".join(f"nvidia.com/gpu={i}" for i in ids)
    elif strategy == "cdi-cri":
        a.cdi_devices = [f"nvidia.com/gpu={i}" for i in ids]
    else:
        raise ValueError(f"unknown device list strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    return a


# -- kubelet ------------------------------------------------------------------------------------

@dataclass
class Pod:
    id: str
    uid: str
    name: str
    config: object  # PodSandboxConfig
    dir: str  # the pod's directory in the node (kubelet's /var/lib/kubelet/pods/<uid>)
    containers: list[str] = field(default_factory=list)


class Kubelet:
    """Runs pods through `cri` as kubelet would. `node_run(argv)` runs a command in the node (to
    write the files kubelet keeps in its pods directory); `cgroup_parent` is the cgroup under
    which every pod of this node goes (kubelet's /kubepods)."""

    def __init__(self, cri: CRI, node_run, cgroup_parent: str, kubelet_dir: str = "/var/lib/kubelet",
                 cgroup_controllers: bool = True):
        self.cri = cri
        # False where the node's cgroup2 has no controllers (a hybrid machine's unified
        # hierarchy): kubelet's CPU settings would then fail to apply, so none are sent.
        self.cgroup_controllers = cgroup_controllers
        self.node_run = node_run
        self.cgroup_parent = cgroup_parent.rstrip("/")
        self.kubelet_dir = kubelet_dir
        self.pods: dict[str, Pod] = {}

    def run_pod(self, name: str, *, runtime_handler: str = "", namespace: str = "default",
                annotations: dict | None = None) -> Pod:
        p = pb()
        uid = str(uuid.uuid4())
        pod_dir = f"{self.kubelet_dir}/pods/{uid}"
        sa = f"{pod_dir}/volumes/kubernetes.io~projected/kube-api-access-{uid[:5]}"
        # kubelet's pod directory: the managed /etc/hosts and the service account token volume
        # (kubelet writes a tmpfs there; the files are what a pod reads).
        self.node_run(["sh", "-c", f'set -e; mkdir -p "{pod_dir}/containers" "{sa}"; '
                       f'printf "127.0.0.1\\tlocalhost\\n::1\\tlocalhost\\n" > "{pod_dir}/etc-hosts"; '
                       f'printf "token-{uid[:8]}" > "{sa}/token"; printf "{namespace}" > "{sa}/namespace"; '
                       f'printf "%s\\n" "-----BEGIN CERTIFICATE-----" > "{sa}/ca.crt"'])
        cfg = p.PodSandboxConfig(
            metadata=p.PodSandboxMetadata(name=name, uid=uid, namespace=namespace, attempt=0),
            hostname="",  # the node's network and UTS namespaces: runc refuses a hostname there
            log_directory=f"/var/log/pods/{namespace}_{name}_{uid}",
            dns_config=p.DNSConfig(servers=["10.96.0.10"], searches=[f"{namespace}.svc.cluster.local"],
                                   options=["ndots:5"]),
            labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace,
                    "io.kubernetes.pod.uid": uid},
            annotations={"kubernetes.io/config.source": "api", **(annotations or {})},
            linux=p.LinuxPodSandboxConfig(
                cgroup_parent=f"{self.cgroup_parent}/pod{uid}",
                security_context=p.LinuxSandboxSecurityContext(
                    namespace_options=p.NamespaceOption(network=p.NODE, pid=p.CONTAINER, ipc=p.POD))))
        sid = self.cri.RunPodSandbox(config=cfg, runtime_handler=runtime_handler).pod_sandbox_id
        pod = Pod(sid, uid, name, cfg, pod_dir)
        self.pods[sid] = pod
        return pod

    def create_container(self, pod: Pod, name: str, image: str, *, command: list[str] | None = None,
                         env: dict | None = None, gpu: Allocation | None = None,
                         resources: dict | None = None, privileged: bool = False,
                         annotations: dict | None = None, readonly_rootfs: bool = False) -> str:
        p = pb()
        gpu = gpu or Allocation()
        ns, uid = pod.config.metadata.namespace, pod.uid
        term = f"{pod.dir}/containers/{name}/{uuid.uuid4().hex[:8]}"
        self.node_run(["sh", "-c", f'mkdir -p "{pod.dir}/containers/{name}" && : > "{term}"'])
        sa = f"{pod.dir}/volumes/kubernetes.io~projected/kube-api-access-{uid[:5]}"
        mounts = [p.Mount(container_path="/etc/hosts", host_path=f"{pod.dir}/etc-hosts"),
                  p.Mount(container_path="/dev/termination-log", host_path=term),
                  p.Mount(container_path="/var/run/secrets/kubernetes.io/serviceaccount", host_path=sa,
                          readonly=True)]
        mounts += [p.Mount(container_path=c, host_path=h, readonly=ro) for c, h, ro in gpu.mounts]
        envs = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443",
                **(env or {}), **gpu.envs}
        defaults = {"cpu_shares": 2, "cpu_period": 100000} if self.cgroup_controllers else {}
        res = p.LinuxContainerResources(oom_score_adj=1000, **{**defaults, **(resources or {})})
        cfg = p.ContainerConfig(
            metadata=p.ContainerMetadata(name=name, attempt=0),
            image=p.ImageSpec(image=image),
            command=command or ["/bin/sleep", "3600"],
            envs=[p.KeyValue(key=k, value=v) for k, v in envs.items()],
            mounts=mounts,
            labels={"io.kubernetes.container.name": name, "io.kubernetes.pod.name": pod.name,
                    "io.kubernetes.pod.namespace": ns, "io.kubernetes.pod.uid": uid},
            annotations={"io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
                         **(annotations or {}), **gpu.annotations},
            log_path=f"{name}/0.log",
            linux=p.LinuxContainerConfig(
                resources=res,
                security_context=p.LinuxContainerSecurityContext(
                    privileged=privileged, readonly_rootfs=readonly_rootfs,
                    namespace_options=p.NamespaceOption(network=p.NODE, pid=p.CONTAINER, ipc=p.POD),
                    masked_paths=[] if privileged else ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/timer_list",
                                                        "/sys/firmware"],
                    readonly_paths=[] if privileged else ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                                                          "/proc/sysrq-trigger"])),
            CDI_devices=[p.CDIDevice(name=n) for n in gpu.cdi_devices])
        cid = self.cri.CreateContainer(pod_sandbox_id=pod.id, config=cfg, sandbox_config=pod.config).container_id
        pod.containers.append(cid)
        return cid

    def start(self, cid: str) -> None:
        self.cri.StartContainer(container_id=cid)

    def run_container(self, pod: Pod, name: str, image: str, **kw) -> str:
        """CreateContainer then StartContainer; the container id."""
        cid = self.create_container(pod, name, image, **kw)
        self.start(cid)
        return cid

    def exec(self, cid: str, cmd: list[str] | str, timeout: int = 60) -> tuple[int, str, str]:
        """ExecSync: (exit code, stdout, stderr). A string runs with /bin/sh -c."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd
        r = self.cri.ExecSync(container_id=cid, cmd=argv, timeout=timeout)
        return r.exit_code, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")

    def status(self, cid: str):
        return self.cri.ContainerStatus(container_id=cid).status

    def remove_pod(self, pod: Pod) -> None:
        """What kubelet does when a pod is deleted: stop and remove each container, then the
        sandbox, then the pod's directory."""
        for cid in pod.containers:
            try:
                self.cri.StopContainer(container_id=cid, timeout=5)
                self.cri.RemoveContainer(container_id=cid)
            except CRIError as e:
                if e.code != "NOT_FOUND":
                    raise
        self.cri.StopPodSandbox(pod_sandbox_id=pod.id)
        self.cri.RemovePodSandbox(pod_sandbox_id=pod.id)
        self.node_run(["rm", "-rf", pod.dir])
        self.pods.pop(pod.id, None)

    def remove_all(self) -> None:
        for pod in list(self.pods.values()):
            self.remove_pod(pod)
