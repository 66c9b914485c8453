"""decide: pure functions from (request, inventory, image facts, config) to a plan. No I/O:
everything these modules need arrives as arguments, so each rule is tested without a host."""
