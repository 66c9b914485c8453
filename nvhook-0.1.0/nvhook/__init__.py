"""nvhook: an OCI runtime hook that gives containers the host's NVIDIA driver."""

__version__ = "0.1.0"
