import pytest

from nvhook.base.errors import HookError
from nvhook.decide import requirements as rq

FACTS = {"cuda": "12.2", "driver": "535.261.03"}
T4 = {"cc": "7.5", "brand": "tesla"}
RTX = {"cc": "8.9", "brand": "geforcertx"}


def ok(expr, gpus=(), facts=FACTS):
    return rq.satisfied(rq.parse(expr), facts, list(gpus))


def test_versions_compare_numerically_per_component():
    assert ok("cuda>=12.0") and ok("cuda>=12.2") and not ok("cuda>12.2")
    assert ok("driver>=535.54.03")  # digit-string comparison would say 261 < 54
    assert not ok("driver<535.100")
    assert ok("cuda<12.10")  # 12.2 < 12.10 numerically


def test_space_is_or_and_comma_is_and():
    cuda_images_style = "cuda>=12.4 brand=tesla,driver>=470,driver<471 brand=tesla,driver>=535,driver<536"
    assert ok(cuda_images_style, [T4])
    assert not ok(cuda_images_style, [RTX])
    assert ok("cuda>=12.4 driver>=530")


def test_arch_and_brand_hold_for_every_selected_gpu():
    assert ok("arch>=7.0", [T4, RTX])
    assert not ok("arch>=8.0", [T4, RTX])
    assert ok("brand!=geforce", [T4])
    assert ok("brand=TESLA", [T4])


def test_unknown_gpu_facts_do_not_satisfy():
    assert not ok("arch>=7.0", [{"cc": None, "brand": None}])


def test_no_gpu_selected_makes_gpu_terms_vacuous():
    assert ok("arch>=9.0", [])


def test_gpu_facts_needed_only_when_other_alternatives_fail():
    p = rq.parse("cuda>=12.0 brand=tesla,driver>=418")
    assert rq.alternatives_without_gpu_facts_hold(p, FACTS)
    p = rq.parse("cuda>=13.0 brand=tesla,driver>=418")
    assert not rq.alternatives_without_gpu_facts_hold(p, FACTS)


@pytest.mark.parametrize("expr,msg", [
    ("gpu>=1", "unknown requirement key 'gpu'"),
    ("cuda", "malformed requirement"),
    ("cuda>=", "has no value"),
    ("brand>=tesla", "brand only supports"),
    ("driver>=abc", "numeric version"),
])
def test_malformed_requirements_name_the_term(expr, msg):
    with pytest.raises(HookError, match=msg):
        rq.parse(expr, "NVIDIA_REQUIRE_X")
