"""decide: pure functions from (request, inventory, image facts, config) to a plan. No I/O:
everything these modules need arrives as arguments, so each rule is tested without a host.

sources.py names what a front door asks about (an OCI bundle, an NRI container, a CDI
container's devices) and what comes back; request.py reads the request, plan.py selects GPUs
and builds the plan (types.py), compat.py makes the forward-compat choice, edits.py turns a plan
into container edits, cdimodel.py into a CDI spec (cdicheck.py compares one with the host).
nvhook.start.pipeline joins them to observe."""
