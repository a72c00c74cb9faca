"""`make test` collects tests/ and tests/unit/ in one pytest run, which imports test modules by
their base name: two with the same name stop the whole lane at collection ("import file
mismatch"), so every name must be unique across both folders."""
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_module_name_is_used_twice():
    top = {p.name for p in TESTS.glob("test_*.py")}
    unit = {p.name for p in (TESTS / "unit").glob("test_*.py")}
    assert top and unit, "no test modules found: this check would prove nothing"
    assert top & unit == set()
