"""`nvhook nri`: run nvhook as an NRI plugin (the plugin itself: start/nri/plugin.py)."""

from __future__ import annotations

import click

from .clikit import Ctx


@click.command(name="nri")
@click.option("--socket", "socket_path", default="/var/run/nri/nri.sock", show_default=True, metavar="PATH",
              help="The engine's NRI socket (containerd's [plugins.\"io.containerd.nri.v1.nri\"] socket_path).")
@click.option("--name", default="nvhook", show_default=True, help="Plugin name the engine logs.")
@click.option("--index", default="10", show_default=True, metavar="NN",
              help="Plugin index (two digits): plugins are called in ascending order.")
@click.option("--hook-path", metavar="PATH", help="nvhook as the runtime should run it for in-container work "
              "[default: the nvhook beside this one].")
@click.option("--mask-procfs/--no-mask-procfs", default=False, show_default=True,
              help="Show a GPU container only its own GPUs under /proc/driver/nvidia. Needs nvhook's hook in "
                   "every GPU container (runc refuses spec mounts under /proc).")
@click.option("--runtime-handler", "runtime_handlers", multiple=True, metavar="NAME",
              help="A runtime class whose runtime injects the GPU itself (nvhook-runtime, NVIDIA's runtime): its "
                   "pods are left to it, neither adjusted nor reported as missing their GPU. Repeatable "
                   "[default: nvhook, nvidia; give '' for none].")
@click.option("--cdi-annotation-namespace", "cdi_namespaces", multiple=True, metavar="NAMESPACE",
              help="A Kubernetes namespace whose pods may name CDI devices in the pod annotation "
                   "nvidia.cdi.k8s.io/container.<name> (NVIDIA's NRI plugin's: the GPU Operator's management "
                   "pods); the engine resolves them. Repeatable; replaces the config's "
                   "nri.cdi_annotation_namespaces [default: that list, empty: none].")
@click.pass_obj
def nri(c: Ctx, socket_path, name, index, hook_path, mask_procfs, runtime_handlers, cdi_namespaces):
    """Serve as an NRI plugin: GPU containers get their devices, binds and cgroup rules in their own spec,
    with no runtime class and no nvhook process per container (docs/nri.md)."""
    from ..start.nri.plugin import run

    return run({"config": c.config_path, "root": c.root_opt, "socket": socket_path, "name": name, "index": index,
                "hook_path": hook_path, "mask_procfs": mask_procfs,
                "runtime_handlers": runtime_handlers, "cdi_namespaces": cdi_namespaces})
