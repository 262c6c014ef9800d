"""The refused-character class of plain-text fields covers every control and format character."""

from __future__ import annotations

import unicodedata

from controlplane.wire.common import KNOWN_CONTROLS, refused_codes


def test_the_known_table_is_this_pythons_unicode() -> None:
    known = KNOWN_CONTROLS.get(unicodedata.unidata_version)
    if known is None:  # another Python: the class is scanned at import, nothing to compare
        return
    assert [code for low, high in known for code in range(low, high + 1)] == refused_codes()
