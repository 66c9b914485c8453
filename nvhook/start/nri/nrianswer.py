"""The NRI plugin's answer to a GPU container: nvhook's decision (the pipeline every front door
shares) turned into container edits, the binds placed where the image's loader finds them
(decide/nriwork.py), the in-container work left to the plugin's StartContainer (the loader
files, the application profile of a graphics or display container) or to nvhook's CDI hook,
and the ContainerAdjustment's bytes (apply/nriadjust.py).

Speed: answers are kept, keyed by what the decision read of the container
(decide.nriwork.answer_key), and served again only after the check every decision starts with
(the inventory's inputs, the GPU list and device nodes, read again).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from ...base.nrimessages import Container
from ...decide.nriwork import IN_PLUGIN, StartWork

# How many answers are kept (each a few KiB).
MAX_KEPT = 256


@dataclass
class Answer:
    """`adjust`: the ContainerAdjustment's bytes (b"": the container as the engine made it, or
    not encoded: `AnswerBook.answer(encode=False)`); `summary`: the `nri.adjusted` event's
    fields; `work`: what is left to the plugin at the container's start, or None."""

    adjust: bytes
    summary: dict
    work: StartWork | None


class AnswerBook:
    def __init__(self, cfg: dict, root: str, hook_path: str, hook_global_args: list, mask_procfs: bool):
        self.cfg, self.root = cfg, root
        self.hook_path, self.hook_global_args = hook_path, list(hook_global_args)
        self.mask_procfs = mask_procfs
        # Answers already decided, by what the decision read of the container: each is served
        # again only while the host it was decided on is the host now (`kept`).
        self.answers: dict[str, dict] = {}
        # One decision at a time: they read and refresh the host's inventory cache, which is
        # shared. A container's own files are never read under it (start/nri/nristart.py).
        self.lock = threading.Lock()
        # Where each image's loader looks by default, as its last start showed (by
        # decide.nriwork.image_key): learned by the start work, read by the decisions.
        self.searched: dict[str, tuple[str, ...]] = {}
        self.searched_lock = threading.Lock()

    def learn(self, image: str, defaults: tuple[str, ...] | None) -> None:
        """Record what a start of image `image` showed of its loader (None: nothing to go by,
        forgotten: its next container is bound in every family's directories)."""
        from ...decide.nriwork import MAX_IMAGES

        with self.searched_lock:
            self.searched.pop(image, None)
            if defaults is not None:
                if len(self.searched) >= MAX_IMAGES:
                    del self.searched[next(iter(self.searched))]
                self.searched[image] = defaults

    def answer(self, c: Container, request: dict, log, encode: bool = True, namespace: str = "",
               learned: bool = True) -> Answer:
        """The answer for container `c` of a pod in `namespace`, whose request
        (decide.request.parse) is `request`; with `learned` False, as for an image nothing is
        known of (its libraries in every family's directories)."""
        from ...decide.nriwork import answer_key, image_key

        image = image_key(c.annotations, namespace)
        with self.searched_lock:
            searched = self.searched.get(image) if image is not None and learned else None
        key = answer_key(request, c.env, searched)
        log.bind(container=c.id)
        with self.lock:
            answer = self.kept(key, request, log) or self.decided(c, request, key, log, encode, searched)
        if answer.work is not None and image is not None:
            from dataclasses import replace

            # Kept answers are shared by every image their key fits; the image is this one's.
            return Answer(answer.adjust, answer.summary, replace(answer.work, image=image))
        return answer

    def bound_work(self, c: Container, request: dict, log, namespace: str) -> StartWork | None:
        """The start work of container `c` decided again (not encoded: the plugin restarted since
        its creation, or Synchronize), narrowed to the directories its libraries are bound in.
        Decided for every family's directories, whatever was learned of the image since: the
        container's binds were made by what was known at its creation (by another process, or
        before a start that taught this one otherwise), and only they tell which it has."""
        from ...decide.nriwork import as_bound

        work = self.answer(c, request, log, encode=False, namespace=namespace, learned=False).work
        return None if work is None else as_bound(work, c.destinations())

    def kept(self, key: str | None, request: dict, log) -> Answer | None:
        """The answer already decided for `key`, if the host is still the one it was decided on:
        the same inventory (the cache's own check, every file the scan looked at, runs on each
        use: a driver upgrade or a library that came or went is a miss) and the same GPUs with
        the same device nodes (read again from /proc/driver/nvidia and /dev)."""
        memo = self.answers.get(key) if key is not None else None
        if memo is None:
            return None
        from ...decide import plan as plan_mod
        from ...observe import host

        inv = host.observe(self.root, self.cfg["cache_dir"], log,
                           capabilities=plan_mod.expand_capabilities(request["capabilities"]))
        if inv["files"]["inputs"] != memo["inputs"] or inv["gpus"] != memo["gpus"]:
            del self.answers[key]  # type: ignore[arg-type]
            return None
        return Answer(memo["adjust"], dict(memo["summary"], cached=True), memo["work"])

    def decided(self, c: Container, request: dict, key: str | None, log, encode: bool,
                searched: tuple[str, ...] | None = None) -> Answer:
        from ...apply import nriadjust
        from ...decide import edits as edits_mod
        from ...decide import nriwork
        from ...decide.sources import Host
        from .. import pipeline

        # No rootfs: the image is not readable at CreateContainer; the plan is for any image.
        decision = pipeline.decide(decide_source(c, request), Host(self.root, self.cfg, log))
        plan, known = decision.plan, decision.facts
        if not plan["mounts"] and not plan["symlinks"]:
            return Answer(b"", {"gpus": [], "reason": plan["compat"]["reason"]}, None)
        edits = edits_mod.from_plan(plan)
        driver_cuda = pipeline.cuda_for(known["inventory"]) if "inventory" in known else None
        why = nriwork.in_container_work(plan, edits, c.env, driver_cuda, self.mask_procfs)
        hook = None
        work = None
        if any(w not in IN_PLUGIN for w in why):
            # The hook does all of it (its binds are a CDI spec's), as before.
            mounts = edits_mod.spec_mounts(edits)
            hook = self.hook(plan["request"]["capabilities"])
        else:
            dirs, guessed = nriwork.bind_dirs(edits, c.env, why, os.uname().machine, searched)
            mounts = nriwork.loader_mounts(edits, dirs)
            caps = list(known.get("capabilities") or [])
            # With no hook, the application profile is the plugin's to write at the start.
            profile, left_out = nriwork.start_profile(caps, edits["device_nodes"])
            if left_out:
                log.warning("app_profile.minors_left_out", minors=left_out,
                            message="the application profile's mask has bits for minors 0-63 only: EGL and "
                                    "Vulkan do not see these GPUs")
            if why or profile:
                libs = [m["container_path"] for m in mounts if m["kind"] == "library"]
                work = StartWork(list(why) + ["profile"] * bool(profile), dirs, libs, caps,
                                 [g["index"] for g in known.get("selected") or []], profile, guessed=guessed)
        summary = {"gpus": [g["index"] for g in plan["gpus"]], "devices": len(edits["device_nodes"]),
                   "mounts": len(mounts), "cgroup_rules": len(edits["cgroup_devices"]),
                   "hook": ",".join(why) if hook else None, "at_start": ",".join(work.why) if work else None,
                   "compat": plan["compat"]["decision"]}
        if not encode:
            return Answer(b"", dict(summary, cached=False), work)
        adjust = nriadjust.adjustment(edits, mounts, hook)
        inv = known.get("inventory")
        # An answer that consulted NVML (GPU brands for the compat choice, MIG) is not kept: what
        # NVML said is not part of the check above.
        if key is not None and inv is not None and inv.get("nvml_state") is None:
            if len(self.answers) >= MAX_KEPT:
                self.answers.clear()
            self.answers[key] = {"inputs": inv["files"]["inputs"], "gpus": inv["gpus"], "adjust": adjust,
                                 "summary": summary, "work": work}
        return Answer(adjust, dict(summary, cached=False), work)

    def hook(self, capabilities: list[str]) -> dict:
        """nvhook's CDI createContainer hook, as an NRI Hook."""
        from ...base.launch import registration
        from ...decide import cdimodel as cdi

        path, argv0 = registration(self.hook_path)
        args = cdi.hook_args(capabilities, self.hook_global_args)
        return {"path": path, "args": [*argv0, *args[1:]], "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}


def decide_source(c: Container, request: dict | None = None, rootfs: str | None = None):
    """The NRI container as pipeline.decide's source (decide/sources.py), with the request the
    plugin parsed already. The engine does not tell a plugin the container's capabilities: it
    counts as unprivileged."""
    from ...decide.sources import NriContainer

    return NriContainer(c.id, c.env, c.mount_dicts(), c.annotations, c.device_dicts(), rootfs=rootfs,
                        pid=c.pid or None, request=request)
