from __future__ import annotations

import pytest

from graphpool import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 << 30),
        ("512 MiB", 512 << 20),
        ("1.5g", 3 << 29),
        ("2GB", 2_000_000_000),
        ("4096", 4096),
        ("64k", 64 << 10),
        (4096, 4096),
        (0, 0),
    ],
)
def test_parse_size(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad",
    ["", "GiB", "12 parsecs", "99999999999TiB", "-1", -1, "1.2.3G", "1.5", "0.4", "2.5B", "18446744073709551616"],
)
def test_parse_size_rejects(bad: int | str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(bad)


def test_parse_size_rejects_bool() -> None:
    with pytest.raises(TypeError):
        parse_size(True)


def test_format_size() -> None:
    assert format_size(0) == "0 B"
    assert format_size(2 << 20) == "2 MiB"
    assert format_size(3 << 29) == "1.50 GiB"
    assert format_size(1023) == "1023 B"
