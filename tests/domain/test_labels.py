from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.domain import labels
from controlplane.errors import InvalidInput, RunnerLabelsReserved


def test_j02_canonicalise_trims_lowercases_dedupes_and_sorts() -> None:
    assert labels.canonicalise(["Ubuntu22", " ubuntu22 ", "LINUX"]) == ("linux", "ubuntu22")


def test_j04_whitespace_only_labels_canonicalise_to_empty() -> None:
    assert labels.canonicalise([" ", "\t"]) == ()


def test_plain_string_is_one_label_and_none_is_empty() -> None:
    assert labels.canonicalise(" GPU ") == ("gpu",)
    assert labels.canonicalise(None) == ()


def test_j115_grammar_bounds() -> None:
    assert labels.validate(["a" * 128]) == ("a" * 128,)
    assert len(labels.validate([f"l{i}" for i in range(20)])) == 20
    for bad in (["a" * 129], [f"l{i}" for i in range(21)], ["linux/amd64"], [" linux"], []):
        with pytest.raises(InvalidInput):
            labels.validate(bad)


def test_j134_s99_reserved_labels_parse_and_refuse_bad_entries() -> None:
    assert labels.parse_reserved(" ShipFox-Managed, Linux,shipfox-managed ") == (
        "linux",
        "shipfox-managed",
    )
    assert labels.parse_reserved("") == ()
    with pytest.raises(InvalidInput):
        labels.parse_reserved("has space")


def test_strip_reserved_keeps_order_of_the_rest() -> None:
    assert labels.strip_reserved(("linux", "managed", "x64"), ("managed",)) == ("linux", "x64")


def test_j19_j20_j21_match_rule() -> None:
    assert labels.matches(("linux",), ("linux", "x64"))
    assert labels.matches(("linux", "x64"), ("linux", "x64"))
    assert not labels.matches(("macos",), ("linux", "x64"))
    assert not labels.matches(("linux",), ())


@given(st.lists(st.text(max_size=8), max_size=10))
def test_canonicalise_is_idempotent_and_sorted(raw: list[str]) -> None:
    once = labels.canonicalise(raw)
    assert labels.canonicalise(once) == once
    assert list(once) == sorted(set(once))
    assert all(label and label == label.strip().lower() for label in once)


RESERVED = labels.canonicalise(["gpu", "privileged"])


def test_provisioned_labels_strip_reserved_ones_below_installation_scope() -> None:
    kept = labels.provisioned_labels([" Linux", "GPU", "x64"], "workspace", RESERVED)
    assert kept == ("linux", "x64")


def test_provisioned_labels_keep_reserved_ones_for_an_installation_provisioner() -> None:
    kept = labels.provisioned_labels(["linux", "gpu"], "installation", RESERVED)
    assert kept == ("gpu", "linux")


@pytest.mark.parametrize("scope", ["workspace", None])
def test_provisioned_labels_refuse_a_runner_left_with_no_label(scope: str | None) -> None:
    with pytest.raises(RunnerLabelsReserved) as refused:
        labels.provisioned_labels(["GPU", "privileged"], scope, RESERVED)
    assert refused.value.details == {"labels": ["gpu", "privileged"]}
