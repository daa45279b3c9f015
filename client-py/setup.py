"""Build hook: compiles the native allocator shim (crates/shim, a Rust cdylib) with cargo and
ships it as ``graphpool/_native/libgraphpool_shim.so``.

Set ``GRAPHPOOL_SKIP_SHIM=1`` to install only the pure-Python parts (no Rust toolchain needed;
``graphpool.torch`` then finds the shim through ``GRAPHPOOL_SHIM=/path/to/libgraphpool_shim.so``).
``GRAPHPOOL_SHIM_PROFILE=debug`` builds the shim unoptimized (faster, for test runs).
cargo honours ``CARGO_TARGET_DIR`` as usual (default: the workspace's ``target/``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
SHIM_MANIFEST = HERE.parent / "crates" / "shim" / "Cargo.toml"
SKIP = os.environ.get("GRAPHPOOL_SKIP_SHIM", "").lower() in ("1", "true", "yes", "on")
# `debug` builds faster (test runs); wheels for GPU machines should use the default, release.
PROFILE = os.environ.get("GRAPHPOOL_SHIM_PROFILE", "release")

HOW = (
    "Either install a Rust toolchain (https://rustup.rs, then `cargo` on PATH), install a wheel "
    "built on another machine (`pip wheel ./client-py` there, then `pip install "
    "graphpool-*.whl` here), or set GRAPHPOOL_SKIP_SHIM=1 to install the Python parts only "
    "(graphpool.torch then needs GRAPHPOOL_SHIM=/path/to/libgraphpool_shim.so)."
)

kwargs: dict[str, object] = {}
if not SKIP:
    if not SHIM_MANIFEST.is_file():
        raise SystemExit(
            f"graphpool: the shim's sources are not at {SHIM_MANIFEST}. Build from a checkout of "
            f"the repository (`pip install ./client-py` or `pip wheel ./client-py`; an sdist "
            f"alone does not contain crates/shim). {HOW}"
        )
    if PROFILE not in ("release", "debug"):
        raise SystemExit(f"graphpool: GRAPHPOOL_SHIM_PROFILE must be release or debug, not {PROFILE!r}")
    if shutil.which("cargo") is None:
        raise SystemExit(f"graphpool: cargo not found on PATH; it builds the native allocator shim. {HOW}")

    from setuptools_rust import Binding, RustExtension
    from wheel.bdist_wheel import bdist_wheel

    class BdistWheel(bdist_wheel):  # type: ignore[misc]
        """The shim has no Python ABI: tag the wheel py3-none-<platform> so one wheel serves
        every CPython version (3.10 to 3.13) on that platform."""

        def get_tag(self) -> tuple[str, str, str]:
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    kwargs["rust_extensions"] = [
        RustExtension(
            "graphpool._native.libgraphpool_shim",
            path=str(SHIM_MANIFEST),
            binding=Binding.NoBinding,
            py_limited_api=False,
            debug=PROFILE == "debug",
        )
    ]
    kwargs["cmdclass"] = {"bdist_wheel": BdistWheel}

setup(**kwargs)  # type: ignore[arg-type]
