"""What every layer may use: errors, logging, JSON, config, paths under a root, versions,
the driver-file catalog and the ctypes syscall layer. Imports nothing from observe, decide
or apply."""
