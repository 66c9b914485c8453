"""What runs as root on every container start, one module or folder per process (front door):

- hook.py      the OCI hook (bin/nvhook in hook mode; nvhook.entry routes it here): observe,
               decide and apply in this process; also nvhook's CDI hook (--cdi CAPS)
- client.py    the same hook's first stop: hands the start to a warm nvhookd when one serves it
- daemon/      nvhookd, the resident daemon that serves those starts in a forked child (its
               __init__ says which module holds what)
- runtime.py   nvhook-runtime, the runc wrapper Docker and containerd run for every runtime call
- cdihook/     nvidia-cdi-hook, NVIDIA's CDI hook command line for specs NVIDIA's tools wrote: one
               module per subcommand, named after it (its __init__ maps them)
- nri/         `nvhook nri`, the NRI plugin containerd and CRI-O call
- pipeline.py  observe -> decide for all of them: decide(source, host, options), the source
               one of decide/sources.py's (and the commands' --dry-run and doctor use it too)
- cdispecs.py  the CDI spec a host gets, shared by nvhookd's refresh and `nvhook cdi`

None of this imports nvhook.commands, click or structlog (tests/test_layers.py).
"""
