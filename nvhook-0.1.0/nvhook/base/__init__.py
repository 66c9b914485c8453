"""What every layer may use: errors, logging, JSON, config, paths under a root, versions,
the driver-file catalog and the syscall layer (on `_ctypes`, through `ffi`). Imports nothing from observe, decide
or apply."""
