"""The host side's bounded memo (dmattn_cute/memo.py)."""

from __future__ import annotations

from dmattn_cute.memo import remember


def test_remember_makes_once_keeps_none_and_empties_when_full() -> None:
    table, made = {}, []

    def make(value):
        return lambda: made.append(value) or value

    assert remember(table, "a", make(1), limit=2) == 1
    assert remember(table, "a", make(2), limit=2) == 1  # a hit: not made again
    assert remember(table, "b", make(None), limit=2) is None
    assert remember(table, "b", make(3), limit=2) is None  # a None value is a hit too
    assert made == [1, None]
    assert remember(table, "c", make(4), limit=2) == 4  # full: emptied, then stored
    assert table == {"c": 4}
