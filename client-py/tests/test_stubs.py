"""The checked-in stubs are what tools/gen_stubs.py makes from proto/ (no drift)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

CLIENT = Path(__file__).resolve().parents[1]


def _load_gen() -> object:
    spec = importlib.util.spec_from_file_location("gen_stubs", CLIENT / "tools" / "gen_stubs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stubs_match_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed")
    from importlib.metadata import version

    gen = _load_gen()
    pinned = gen.GRPCIO_TOOLS_VERSION  # type: ignore[attr-defined]
    if version("grpcio-tools") != pinned:
        pytest.skip(f"grpcio-tools {version('grpcio-tools')} installed, stubs are pinned to {pinned}")
    gen.generate(tmp_path)  # type: ignore[attr-defined]
    checked_in = CLIENT / "src" / "graphpool" / "_proto"
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    have = sorted(
        p.relative_to(checked_in)
        for p in checked_in.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert fresh == have, "stub files differ: run `python client-py/tools/gen_stubs.py`"
    stale = [str(r) for r in fresh if (tmp_path / r).read_bytes() != (checked_in / r).read_bytes()]
    assert not stale, f"stubs are stale ({', '.join(stale)}): run `python client-py/tools/gen_stubs.py`"


def test_stub_imports_are_package_relative() -> None:
    stubs = [
        p for p in (CLIENT / "src" / "graphpool" / "_proto").rglob("*") if p.suffix in (".py", ".pyi")
    ]
    assert stubs
    for p in stubs:
        text = p.read_text()
        assert "from graphpool.v1" not in text and "import graphpool.v1" not in text, p
