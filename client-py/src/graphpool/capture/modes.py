"""The modes a layer is captured in (training mode, autocast) and whether a call still matches
them."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:  # pragma: no cover
    from .layers import _Layer


def _autocast_dtype() -> Any:
    """The dtype CUDA autocast casts to in this thread (a ``torch.dtype``), or None where it
    is off."""
    import torch

    try:
        return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    except (TypeError, AttributeError):  # torch before 2.4: no per-device-type forms
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def _autocast_name(dtype: Any) -> str:
    return "without autocast" if dtype is None else (
        f"under torch.autocast(dtype={str(dtype).replace('torch.', '')})"
    )


@contextlib.contextmanager
def _uncached_autocast(dtype: Any) -> Any:
    """Autocast's weight cache off for the warm-up and the capture, under a caller's
    ``torch.autocast``: a cached cast would be captured as a constant (the graphs would read
    the weight of the step that filled the cache, never an updated one), its memory would be
    given back to the pools when the autocast region ends while the graphs still use it, and a
    cast cached by an eager forward holds that forward's gradient accumulators, whose stream
    breaks the backward's capture. Every cast is then made inside the graph, at each replay.
    """
    import torch

    if dtype is None:
        yield
        return
    torch.clear_autocast_cache()
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


def _mode_changed(lay: "_Layer") -> Any:
    """The first of the layer's modules whose training mode differs from the capture's, or
    None."""
    mods, flags = lay.modes
    return next((m for m, f in zip(mods, flags) if m.training != f), None)
