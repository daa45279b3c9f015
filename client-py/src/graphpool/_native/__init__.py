"""Where the native allocator shim (``libgraphpool_shim.so``) lives.

``pip install ./client-py`` builds the shim from ``crates/shim`` and ships it in this
directory. ``GRAPHPOOL_SHIM`` overrides it (a path to a ``libgraphpool_shim.so`` built
elsewhere, e.g. ``target/release/libgraphpool_shim.so`` of a checkout).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SHIM_ENV", "native_path"]

#: Environment variable naming the shim library explicitly.
SHIM_ENV = "GRAPHPOOL_SHIM"


def native_path() -> str | None:
    """Returns the path of ``libgraphpool_shim.so``, or ``None`` when there is none.

    Order: ``$GRAPHPOOL_SHIM``, then the library shipped in this package. The variable's path
    is returned resolved: ``~`` expanded, made absolute, symbolic links followed. ``None``
    means the package was installed with ``GRAPHPOOL_SKIP_SHIM=1`` and no ``GRAPHPOOL_SHIM``
    is set.

    Raises:
        FileNotFoundError: ``$GRAPHPOOL_SHIM`` is set but does not name a file (the message
            names the variable and the path).
    """
    env = os.environ.get(SHIM_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise FileNotFoundError(
                f"graphpool: {SHIM_ENV}={env} does not name a file: point it at a "
                f"libgraphpool_shim.so, or unset it to use the library shipped with the package"
            )
        return str(p.resolve())
    here = Path(__file__).resolve().parent
    # setuptools-rust may add the interpreter's extension suffix to the file name.
    for cand in sorted(here.glob("libgraphpool_shim*.so")):
        if cand.is_file():
            return str(cand)
    return None
