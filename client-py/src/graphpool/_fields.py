"""Request fields checked before they reach protobuf: a bad value is an ``InvalidArgument``
naming its field."""

from __future__ import annotations

from .errors import InvalidArgument
from .units import parse_size


def _size_bytes(size: int | str) -> int:
    """A segment size as bytes; a malformed one is ``InvalidArgument`` naming ``size_bytes``."""
    try:
        return parse_size(size)
    except (ValueError, TypeError) as e:
        raise InvalidArgument(str(e), field="size_bytes") from None


def _uint(field: str, value: object, bits: int) -> int:
    """An unsigned integer request field (``rank``, ``grant_id``, ...) checked before it reaches
    protobuf, which would raise a bare ``ValueError``/``TypeError`` (or, for ``None``, silently
    send 0); anything else is ``InvalidArgument`` naming the field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{field} must be an int, not {value!r}", field=field)
    if not 0 <= value < 1 << bits:
        raise InvalidArgument(f"{field} must be between 0 and {(1 << bits) - 1}, got {value}", field=field)
    return value


def _text(field: str, value: object) -> str:
    """A string request field (``job_id``, ``label``); anything else is ``InvalidArgument``."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{field} must be a str, not {value!r}", field=field)
    return value


def _flag(field: str, value: object) -> bool:
    """A bool request field (``reserve``, ``summary_only``): protobuf would raise a bare
    ``TypeError`` for anything else (or take ``1`` as true); it is ``InvalidArgument``."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{field} must be a bool, not {value!r}", field=field)
    return value
