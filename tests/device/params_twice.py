"""disable-device-node-modification run twice for one container, against the real driver's
/proc/driver/nvidia/params (tests/test_cdihook.py runs the same with a procfs stand-in): the
second run finds nvhook's read-only copy in place and succeeds. Run as root on a GPU machine:
`unshare --mount --propagation private python3 tests/device/params_twice.py` (PYTHONPATH=repo).
With `--control`: without the check for nvhook's copy (the code before it), the second run
fails, so that this check can fail."""

import json
import os
import subprocess
import sys
import tempfile

from nvhook.apply import paramsmask
from nvhook.start.cdihook import disable_device_node_modification, hookstate

control = sys.argv[1:] == ["--control"]
if control:
    paramsmask.masked_already = lambda *a: False
tmp = tempfile.mkdtemp()
rootfs = f"{tmp}/rootfs"
os.makedirs(f"{rootfs}/proc")
subprocess.run(["mount", "-t", "proc", "proc", f"{rootfs}/proc"], check=True)
print("host:", open(paramsmask.PARAMS).read().splitlines())


class Log:
    def __init__(self):
        self.events = []

    def debug(self, event, **kw):
        self.events.append(event)

    info = debug


log = Log()
root = hookstate.open_root(rootfs)
results = []
for _ in range(2):
    try:
        disable_device_node_modification.mask(root, {"root": "/"}, log)
        results.append(None)
    except Exception as e:
        results.append(f"{type(e).__name__}: {e}")
seen = [ln for ln in open(rootfs + paramsmask.PARAMS).read().splitlines() if ln.startswith("ModifyDeviceFiles")]
print(json.dumps({"runs": results, "events": log.events, "container_sees": seen}))
ok = results == [None, None] and seen == ["ModifyDeviceFiles: 0"]
sys.exit(0 if ok != control else 1)
