"""`nvhook nri`: nvhook as an NRI plugin (docs/nri.md). plugin.py is the front door."""
