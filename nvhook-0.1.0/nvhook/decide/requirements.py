"""NVIDIA_REQUIRE_* expressions: parse and evaluate. Pure.

Grammar (reference section 2): an expression is alternatives separated by spaces (OR), each a
comma-separated list of terms (AND), each term `key op value` with op in = != < <= > >=.
Keys: cuda and driver (versions, numeric per component), arch (compute capability, per GPU),
brand (string, = and != only, per GPU). A term on arch/brand holds when it holds for every
selected GPU; with no GPU selected it holds vacuously.
"""

from __future__ import annotations

from ..base.errors import HookError
from ..base.versions import compare
from .request import MAX_REQUIRE_CHARS

OPS = (">=", "<=", "!=", "=", "<", ">")
KEYS = ("cuda", "driver", "arch", "brand")
GPU_KEYS = ("arch", "brand")
# An image writes these variables, so they are hostile input: without a bound, a 400,000-term
# expression took 8 s to parse and check (longer with GPU terms and 8 GPUs). NVIDIA's CUDA
# images use about 1,500 characters and 90 terms; the bounds leave ten times that.
MAX_CHARS = MAX_REQUIRE_CHARS
MAX_TERMS = 1024


def parse(expr: str, source: str = "NVIDIA_REQUIRE") -> list[list[tuple[str, str, str]]]:
    if len(expr) > MAX_CHARS:
        raise HookError(f"{source} is {len(expr)} characters long; nvhook reads at most {MAX_CHARS} "
                        f"(set NVIDIA_DISABLE_REQUIRE=true to skip the check)")
    alternatives = []
    n_terms = 0
    for alt in expr.split():
        terms = []
        for term in alt.split(","):
            term = term.strip()
            if not term:
                continue
            n_terms += 1
            if n_terms > MAX_TERMS:
                raise HookError(f"{source} has more than {MAX_TERMS} terms; nvhook checks at most {MAX_TERMS} "
                                f"(set NVIDIA_DISABLE_REQUIRE=true to skip the check)")
            for op in OPS:
                key, sep, value = term.partition(op)
                if sep:
                    break
            else:
                raise HookError(f"{source}: malformed requirement {term!r} (expected key op value, e.g. cuda>=12.0)")
            key, value = key.strip().lower(), value.strip()
            if key not in KEYS:
                raise HookError(f"{source}: unknown requirement key {key!r} in {term!r} (known: {', '.join(KEYS)})")
            if not value:
                raise HookError(f"{source}: requirement {term!r} has no value")
            if key == "brand" and op not in ("=", "!="):
                raise HookError(f"{source}: brand only supports = and != in {term!r}")
            if key != "brand":
                try:
                    compare(value, value)
                except ValueError:
                    raise HookError(f"{source}: {key} needs a numeric version in {term!r}") from None
            terms.append((key, op, value))
        if terms:
            alternatives.append(terms)
    return alternatives


def uses_gpu_facts(parsed: list) -> bool:
    return any(k in GPU_KEYS for alt in parsed for k, _, _ in alt)


def _holds(op: str, c: int) -> bool:
    return {"=": c == 0, "!=": c != 0, "<": c < 0, "<=": c <= 0, ">": c > 0, ">=": c >= 0}[op]


def _versus(op: str, have: str | tuple[int, ...] | None, value: str) -> bool | None:
    """The comparison, or None when the host's fact is not a version (a driver version guessed
    from a file name such as libcuda.so.1.bak): unknown, like a missing fact."""
    if have is None:
        return None
    try:
        return _holds(op, compare(have, value))
    except (ValueError, TypeError, AttributeError):
        return None


def _term(key: str, op: str, value: str, facts: dict, gpu: dict | None) -> bool | None:
    """True/False, or None when the fact is unknown (treated as not satisfied)."""
    if key in ("cuda", "driver"):
        return _versus(op, facts.get(key), value)
    if gpu is None:
        return True
    if key == "arch":
        return _versus(op, gpu.get("cc"), value)
    have = gpu.get("brand")
    if have is None:
        return None
    same = have.lower() == value.lower()
    return same if op == "=" else not same


def satisfied(parsed: list, facts: dict, gpus: list[dict]) -> bool:
    """facts: {"cuda": str|None, "driver": str}. gpus: the selected GPUs (cc, brand)."""
    if not parsed:
        return True
    per_gpu: list[dict | None] = [None]
    if gpus and uses_gpu_facts(parsed):
        # GPUs with the same facts (8 of one model) are checked once
        per_gpu = list({(g.get("cc"), g.get("brand")): g for g in gpus}.values())
    for gpu in per_gpu:
        seen: dict[tuple[str, str, str], bool | None] = {}  # a term repeated is evaluated once
        if not any(all(_memo(seen, t, facts, gpu) for t in alt) for alt in parsed):
            return False
    return True


def _memo(seen: dict[tuple[str, str, str], bool | None], t: tuple[str, str, str], facts: dict,
          gpu: dict | None) -> bool | None:
    if t not in seen:
        seen[t] = _term(t[0], t[1], t[2], facts, gpu)
    return seen[t]


def alternatives_without_gpu_facts_hold(parsed: list, facts: dict) -> bool:
    """True when some alternative holds on cuda/driver alone: GPU facts (NVML) are not needed."""
    return any(all(k not in GPU_KEYS and _term(k, op, v, facts, None) for k, op, v in alt) for alt in parsed)
