"""The output tail: bounded in UTF-8 bytes, cut on a character boundary, always storable."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controlplane.domain.output import OutputTail, tail_of_output, tail_of_text


def test_short_output_is_kept_whole() -> None:
    assert tail_of_output(b"hello\n", 16) == "hello\n"


def test_the_cut_keeps_the_end_and_never_splits_a_character() -> None:
    text = "é" * 10  # two bytes each
    assert tail_of_text(text, 5) == "éé"  # 5 bytes would split the third from the end
    assert tail_of_output(text.encode(), 5) == "éé"


def test_nul_and_invalid_bytes_are_replaced() -> None:
    assert tail_of_output(b"a\x00b\xffc", 64) == "a\ufffdb\ufffdc"


@given(st.binary(max_size=300), st.integers(min_value=4, max_value=64))
def test_any_bytes_give_a_storable_tail_within_the_limit(data: bytes, limit: int) -> None:
    tail = tail_of_output(data, limit)
    assert len(tail.encode("utf-8")) <= limit
    assert "\x00" not in tail


@given(st.text(max_size=200), st.integers(min_value=4, max_value=64))
def test_a_tail_of_valid_text_is_a_suffix_of_it(text: str, limit: int) -> None:
    tail = tail_of_text(text.replace("\x00", ""), limit)
    assert text.replace("\x00", "").endswith(tail)
    assert len(tail.encode("utf-8")) <= limit


@given(st.lists(st.binary(max_size=50), max_size=30), st.integers(min_value=4, max_value=64))
def test_feeding_in_chunks_equals_the_tail_of_the_whole(chunks: list[bytes], limit: int) -> None:
    tail = OutputTail(limit)
    for chunk in chunks:
        tail.feed(chunk)
    assert tail.text() == tail_of_output(b"".join(chunks), limit)
