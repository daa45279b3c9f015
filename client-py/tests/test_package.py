"""The package itself: import side effects, lazy submodules, the shim's location."""

from __future__ import annotations

from pathlib import Path

import pytest

import graphpool
from gp_helpers import run_python


def test_import_does_not_import_torch() -> None:
    r = run_python("import sys, graphpool; graphpool.Client; print('torch' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_lazy_schedule_export() -> None:
    if not (Path(graphpool.__file__).parent / "schedule.py").exists():
        pytest.skip("graphpool.schedule is not there")
    from graphpool.schedule import Schedule

    assert graphpool.Schedule is Schedule


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError):
        graphpool.no_such_thing  # noqa: B018


def test_native_path_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = tmp_path / "libgraphpool_shim.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("GRAPHPOOL_SHIM", str(lib))
    assert graphpool._native_path() == str(lib)
    monkeypatch.setenv("GRAPHPOOL_SHIM", str(tmp_path / "missing.so"))
    assert graphpool._native_path() is None


def test_default_socket_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHPOOL_SOCKET", "/tmp/some/g.sock")
    assert graphpool.default_socket_path() == "/tmp/some/g.sock"
    assert graphpool.Client().socket_path == "/tmp/some/g.sock"


def test_default_socket_xdg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHPOOL_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    monkeypatch.setattr("graphpool.client.os.path.isdir", lambda p: False)
    assert graphpool.default_socket_path() == "/run/user/1000/graphpool/graphpool.sock"


def test_public_api_is_documented() -> None:
    """Every public class, function, method and property of the package has a docstring."""
    import importlib
    import inspect

    missing = []
    for modname in ("client", "errors", "segments", "units", "schedule", "capture", "_shim"):
        mod = importlib.import_module(f"graphpool.{modname}")
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if not inspect.getdoc(obj):
                missing.append(f"{modname}.{name}")
            if not inspect.isclass(obj):
                continue
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                if isinstance(fn, property):
                    fn = fn.fget
                if inspect.isfunction(fn) and not fn.__doc__:
                    missing.append(f"{modname}.{name}.{attr}")
    assert missing == []
