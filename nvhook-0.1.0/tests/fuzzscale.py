"""The property tests' example budgets, scaled by NVHOOK_FUZZ_SCALE: 1 in `make test`, a fifth in
the unit runs on the other Pythons (.ci/test-pythons), where what differs between versions shows
in the first examples; 10 for a longer local run (tests/test_fuzz.py)."""

from __future__ import annotations

import os

SCALE = float(os.environ.get("NVHOOK_FUZZ_SCALE", "1") or 1)


def examples(n: int) -> int:
    return max(1, int(n * SCALE))
