"""What an operator types: `nvhook COMMAND` (cli.py, click), never run by a container start.
Commands may use everything below them, nvhook.start included (--dry-run is the hook's own
pipeline without the apply step)."""
