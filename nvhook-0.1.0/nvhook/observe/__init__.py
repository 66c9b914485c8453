"""observe: read the OCI state and bundle, the container image and the host (under a
configurable root). Produces plain facts; decides nothing and changes nothing."""
