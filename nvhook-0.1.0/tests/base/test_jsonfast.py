"""nvhook.base.jsonfast must read and write exactly what the json package does."""

import json
import subprocess
import sys

import pytest
from fuzzscale import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from nvhook.base import jsonfast

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=examples(300), deadline=None)
@given(values)
def test_round_trip_matches_json(value):
    for seps in (None, (",", ":")):
        text = jsonfast.dumps(value, separators=seps)
        assert text == json.dumps(value, separators=seps)
        assert jsonfast.loads(text) == json.loads(text)
        assert jsonfast.loads(text.encode()) == json.loads(text)


@settings(max_examples=examples(500), deadline=None)
@given(st.text(max_size=40) | st.binary(max_size=40).map(lambda b: b.decode("latin-1")))
def test_errors_match_json(text):
    try:
        expected = json.loads(text)
    except ValueError:
        with pytest.raises(ValueError):
            jsonfast.loads(text)
    except RecursionError:
        with pytest.raises(RecursionError):
            jsonfast.loads(text)
    else:
        got = jsonfast.loads(text)
        assert got == expected or (got != got and expected != expected)


def test_default_and_unserializable():
    assert jsonfast.dumps({"p": object}, default=lambda o: "x") == '{"p": "x"}'
    with pytest.raises(TypeError):
        jsonfast.dumps({"p": object})


@pytest.mark.parametrize("bad", ['{not json', '[1,]', '{"a" 1}', '"\\q"', '{}x', ''])
def test_errors_in_a_fresh_interpreter(bad):
    """The C scanner needs json.decoder to build its errors; in the hook it is not imported."""
    code = ("import sys, nvhook.base.jsonfast as j\n"
            "try:\n    j.loads(sys.argv[1])\nexcept ValueError as e:\n    print('ValueError', e)\n")
    out = subprocess.run([sys.executable, "-I", "-c", code, bad], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ValueError")


def test_does_not_import_json_or_re():
    code = "import sys, nvhook.base.jsonfast as j; j.loads(j.dumps({'a': [1]})); print('json' in sys.modules, 're' in sys.modules)"
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
