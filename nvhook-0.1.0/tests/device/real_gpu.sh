#!/bin/bash
# nvhook against a real NVIDIA driver, on a machine with a GPU (not part of `make test`: CI has
# no GPU). Runs nvhook's operator commands, then a real runc container whose prestart hook is
# nvhook, running nvidia-smi and a CUDA driver-API probe (tests/device/cuda_probe.c). What a
# GPU-less run cannot show: the real driver's inventory, NVML, and CUDA working in the container.
#
#   tests/device/real_gpu.sh CARRY OUT
# CARRY holds what the GPU machine may lack: bin/runc (+ lib/libseccomp.so.2), bin/busybox
# (static), bin/cuda_probe, whl/*.whl (nvhook's pure-Python dependencies it lacks), and
# optionally bin/nvidia-ctk (NVIDIA's, built by bench/build_reference_cdi.sh) for the CDI part:
# nvhook's spec, and NVIDIA's spec with nvhook's nvidia-cdi-hook as its hook, each applied to
# config.json by tests/device/cdi_apply.py (the GPU machine has no CDI-aware engine) and run.
set -u
carry=$(cd "$1" && pwd); out=$2
repo=${REPO:-$(cd "$(dirname "$0")/../.." && pwd)}
py=$(command -v python3)
mkdir -p "$out" /tmp/nvh && cd /tmp/nvh || exit 1
step() { echo; echo "=== $*"; }

step machine
uname -r; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,mig.mode.current --format=csv,noheader
ls -l /dev/nvidia* 2>&1 | head -20
ldconfig -p | grep -E 'libcuda\.so|libnvidia-ml\.so' | head
command -v nvidia-smi; readlink -f "$(command -v nvidia-smi)"

"$py" -m pip install -q --no-index --no-deps --target /tmp/nvh/site "$carry"/whl/*.whl || exit 1
export PYTHONPATH="/tmp/nvh/site:$repo"
nvhook() { "$py" -m nvhook "$@"; }

step nvhook info
nvhook --log-file "$out/cli.jsonl" info 2>&1 | tee "$out/info.txt"
step nvhook list
nvhook --log-file "$out/cli.jsonl" list > "$out/list.txt" 2>&1; echo "rc=$?"; head -40 "$out/list.txt"; wc -l "$out/list.txt"
step nvhook cdi generate
nvhook --log-file "$out/cli.jsonl" cdi generate --format json --hook-path "$repo/bin/nvhook" > "$out/cdi.json" 2>"$out/cdi.err"; echo "rc=$?"
head -c 600 "$out/cdi.json"; echo; cat "$out/cdi.err" | head

# A container root: static busybox, this machine's own glibc, the probe.
rootfs=/tmp/nvh/bundle/rootfs
mkdir -p "$rootfs"/{bin,usr/bin,proc,sys,dev,etc,tmp,lib64,lib/x86_64-linux-gnu,usr/lib/x86_64-linux-gnu,run}
cp "$carry/bin/busybox" "$rootfs/bin/busybox"
for a in sh ls cat grep head echo env; do ln -sf busybox "$rootfs/bin/$a"; done
cp "$carry/bin/cuda_probe" "$rootfs/usr/bin/cuda_probe"
for l in libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 libgcc_s.so.1; do
    f=$(ldconfig -p | awk -v l="$l" '$1 == l && /x86-64/ {print $NF; exit}')
    [ -n "$f" ] && cp -L "$f" "$rootfs/lib/x86_64-linux-gnu/$l"
done
cp -L /lib64/ld-linux-x86-64.so.2 "$rootfs/lib64/"
printf '/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n' > "$rootfs/etc/ld.so.conf"
printf 'root:x:0:0::/:/bin/sh\n' > "$rootfs/etc/passwd"
rm -rf /tmp/nvh/pristine; cp -a "$rootfs" /tmp/nvh/pristine  # for runs that must not see what hooks wrote

cat > /tmp/nvh/hook.sh <<HOOK
#!/bin/sh
export PYTHONPATH="$PYTHONPATH"
exec "$py" -m nvhook --log-file "$out/hook.jsonl" --log-level debug "\$@"
HOOK
chmod 755 /tmp/nvh/hook.sh
mkdir -p /tmp/nvh/runc-lib && cp "$carry/lib/"* /tmp/nvh/runc-lib/
runc() { LD_LIBRARY_PATH=/tmp/nvh/runc-lib "$carry/bin/runc" --root /tmp/nvh/runc-state "$@"; }
runc --version

"$py" - "$rootfs" <<'PY'
import json, sys
rootfs = sys.argv[1]
spec = {
  "ociVersion": "1.0.2",
  "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "cwd": "/",
              "args": ["/bin/sh", "-c", "echo --- nvidia-smi; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; echo --- probe; cuda_probe; echo --- nodes; ls -l /dev/nvidia*; echo --- mounts; grep -E 'nvidia|libcuda' /proc/self/mountinfo | awk '{print $5, $6}' | head -40; echo --- procdriver; ls /proc/driver/nvidia 2>&1; cat /proc/driver/nvidia/version 2>&1 | head -2"],
              "env": ["PATH=/usr/bin:/bin", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"],
              "capabilities": {k: ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_SETUID", "CAP_SETGID"] for k in ("bounding", "effective", "permitted")},
              "noNewPrivileges": True},
  "root": {"path": rootfs, "readonly": False},
  "hostname": "gpu",
  "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
             {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
             {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
             {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]}],
  "hooks": {"prestart": [{"path": "/tmp/nvh/hook.sh", "args": ["hook.sh", "prestart"], "timeout": 120}]},
  "linux": {"namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "maskedPaths": ["/proc/kcore"], "readonlyPaths": ["/proc/sys"]},
}
json.dump(spec, open(rootfs + "/../config.json", "w"), indent=1)
PY

step nvhook --dry-run on the container
nvhook --log-file "" --dry-run --bundle /tmp/nvh/bundle 2>&1 | head -60 | tee "$out/plan.txt"
step nvhook doctor on the container
nvhook --log-file "" doctor --bundle /tmp/nvh/bundle 2>&1 | tee "$out/doctor.txt"; echo "doctor rc=${PIPESTATUS[0]}"

step runc run with nvhook as the prestart hook
runc run --bundle /tmp/nvh/bundle nvh-gpu-$$ </dev/null 2>&1 | tee "$out/container.txt"; echo "runc rc=${PIPESTATUS[0]}"
runc delete -f nvh-gpu-$$ 2>/dev/null
step the hook log
"$py" - "$out/hook.jsonl" <<'PY'
import json, sys
for ln in open(sys.argv[1]):
    e = json.loads(ln)
    if e.get("event") in ("hook.start", "hook.done", "hook.failed", "compat.decision", "apply.done", "request", "nvml.done"):
        print(e.get("event"), {k: e[k] for k in e if k in ("result", "compat", "phases", "gpus", "error", "devices", "decision", "reason", "symlinks")})
PY
echo; echo "events: $(wc -l < "$out/hook.jsonl")"

# CDI: the same rootfs, no prestart hook; the spec's edits applied as an engine would.
cdi_run() {  # NAME SPEC DEVICE [ROOTFS]
    local b=/tmp/nvh/cdi-$1
    rm -rf "$b"; mkdir -p "$b"
    "$py" - /tmp/nvh/bundle/config.json "$b/config.json" "${4:-}" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["hooks"] = {}
if sys.argv[3]:
    c["root"]["path"] = sys.argv[3]
c["process"]["env"] = [e for e in c["process"]["env"] if not e.startswith("NVIDIA_")]
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
    "$py" "$repo/tests/device/cdi_apply.py" "$2" "$b/config.json" "$3" || return 1
    runc run --bundle "$b" "nvh-cdi-$1-$$" </dev/null 2>&1 | tee "$out/container-cdi-$1.txt"; echo "runc rc=${PIPESTATUS[0]}"
    runc delete -f "nvh-cdi-$1-$$" 2>/dev/null
}
step CDI: nvhook\'s spec, device 0
nvhook --log-file "$out/cli.jsonl" cdi generate --hook-path /tmp/nvh/hook.sh -o "$out/cdi-hooked.json"; echo "rc=$?"
cdi_run nvhook "$out/cdi-hooked.json" 0
step "CDI: nvhook's spec without a hook (--no-hook), device 0; the rootfs's loader is this machine's"
/tmp/nvh/bundle/rootfs/lib64/ld-linux-x86-64.so.2 --list-diagnostics 2>/dev/null | grep -E '^path\.system_dirs' | head -4
nvhook --log-file "$out/cli.jsonl" cdi generate --no-hook -o "$out/cdi-nohook.json"; echo "rc=$?"
rm -rf /tmp/nvh/rootfs-nohook; cp -a /tmp/nvh/pristine /tmp/nvh/rootfs-nohook
cdi_run nohook "$out/cdi-nohook.json" 0 /tmp/nvh/rootfs-nohook

if [ -x "$carry/bin/nvidia-ctk" ]; then
    cat > /tmp/nvh/nvidia-cdi-hook <<HOOK
#!/bin/sh
export PYTHONPATH="$PYTHONPATH"
exec "$py" -IS "$repo/bin/nvidia-cdi-hook" "\$@"
HOOK
    chmod 755 /tmp/nvh/nvidia-cdi-hook
    step "CDI: NVIDIA's spec ($("$carry/bin/nvidia-ctk" --version 2>&1 | head -1)) with nvhook's nvidia-cdi-hook, device 0"
    "$carry/bin/nvidia-ctk" cdi generate --format json --output "$out/cdi-nvidia.json" \
        --nvidia-cdi-hook-path /tmp/nvh/nvidia-cdi-hook 2>&1 | tail -5; echo "rc=$?"
    "$py" -c 'import json,sys; s=json.load(open(sys.argv[1])); print("hooks:", [" ".join(h["args"][1:3]) for h in s["containerEdits"].get("hooks", [])])' "$out/cdi-nvidia.json"
    rm -rf /tmp/nvh/rootfs-nvidia; cp -a /tmp/nvh/pristine /tmp/nvh/rootfs-nvidia
    cdi_run nvidia "$out/cdi-nvidia.json" 0 /tmp/nvh/rootfs-nvidia
    step "the nvidia-cdi-hook log (nvhook's default log file)"
    tail -n 12 /var/log/nvhook.log | cut -c1-400
    # The .deb's two-stage nvidia-cdi-hook: a set-group-ID copy of /bin/sh that ends the entries
    # an earlier one did, then a set-group-ID copy of python3 doing a run of entries in one process.
    fs=$("$py" - "$repo" "$py" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1] + "/tests/e2e")
import cdihookbox
print(cdihookbox.shell_first_stage(Path("/tmp/nvh/fs"), python=sys.argv[2]))
PY
)
    step "CDI: NVIDIA's spec with nvhook's two-stage nvidia-cdi-hook ($fs), device 0"
    "$carry/bin/nvidia-ctk" cdi generate --format json --output "$out/cdi-nvidia-sh.json" \
        --nvidia-cdi-hook-path "$fs" 2>&1 | tail -5; echo "rc=$?"
    n0=$(wc -l < /var/log/nvhook.log 2>/dev/null || echo 0)
    rm -rf /tmp/nvh/rootfs-nvidia-sh; cp -a /tmp/nvh/pristine /tmp/nvh/rootfs-nvidia-sh
    cdi_run nvidia-sh "$out/cdi-nvidia-sh.json" 0 /tmp/nvh/rootfs-nvidia-sh
    echo "hook entries: $("$py" -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["containerEdits"]["hooks"]))' "$out/cdi-nvidia-sh.json")"
    tail -n +"$((n0 + 1))" /var/log/nvhook.log | "$py" -c '
import json, sys
done = [json.loads(l) for l in sys.stdin if "\"cdi_hook.done\"" in l]
print("entries done:", len(done), "by python processes:", sorted({e.get("nvhook_pid") for e in done}),
      "coalesced:", sum(1 for e in done if e.get("coalesced")))'
    ls -l "$(dirname "$(dirname "$fs")")/libexec" "$(dirname "$(dirname "$fs")")/marks" 2>&1 | head
fi
