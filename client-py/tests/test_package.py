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


def test_snapshot_tool_is_a_lazy_submodule_without_torch() -> None:
    """`graphpool.snapshot` comes on first access, and reading snapshots needs no torch."""
    r = run_python(
        "import sys, graphpool; graphpool.snapshot.buffers_from_snapshot; "
        "print('graphpool.snapshot' in sys.modules, 'torch' in sys.modules)"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True False"
    assert "snapshot" in dir(graphpool)


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError):
        graphpool.no_such_thing  # noqa: B018


def test_native_path_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = tmp_path / "libgraphpool_shim.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("GRAPHPOOL_SHIM", str(lib))
    assert graphpool._native_path() == str(lib.resolve())
    # The path is returned resolved, as the docstring says.
    link = tmp_path / "sub" / "link.so"
    link.parent.mkdir()
    link.symlink_to(lib)
    monkeypatch.setenv("GRAPHPOOL_SHIM", str(tmp_path / "sub" / ".." / "sub" / "link.so"))
    assert graphpool._native_path() == str(lib.resolve())
    doc = graphpool._native_path.__doc__ or ""
    assert "resolved" in doc and "as given" not in doc


@pytest.mark.parametrize("name", ["missing.so", "a-directory"])
def test_native_path_env_not_a_file_raises(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A set but wrong GRAPHPOOL_SHIM is an error naming the variable and the path, not a
    silent "no shim installed"."""
    from graphpool import _shim

    (tmp_path / "a-directory").mkdir()
    bad = str(tmp_path / name)
    monkeypatch.setenv("GRAPHPOOL_SHIM", bad)
    with pytest.raises(FileNotFoundError) as e:
        graphpool._native_path()
    assert "GRAPHPOOL_SHIM" in str(e.value) and bad in str(e.value)
    monkeypatch.setattr(_shim, "_lib", None)
    with pytest.raises(FileNotFoundError, match="GRAPHPOOL_SHIM") as e:
        _shim.load()
    assert bad in str(e.value)


def test_attach_documents_every_parameter() -> None:
    import inspect

    doc = inspect.getdoc(graphpool.Client.attach) or ""
    params = [p for p in inspect.signature(graphpool.Client.attach).parameters if p != "self"]
    assert [p for p in params if f"{p}:" not in doc] == []


def test_default_socket_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHPOOL_SOCKET", "/tmp/some/g.sock")
    assert graphpool.default_socket_path() == "/tmp/some/g.sock"
    assert graphpool.Client().socket_path == "/tmp/some/g.sock"


def test_default_socket_xdg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRAPHPOOL_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    monkeypatch.setattr("graphpool.client.os.path.exists", lambda p: False)
    assert graphpool.default_socket_path() == "/run/user/1000/graphpool/graphpool.sock"


def test_default_socket_system_when_its_socket_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """A running system daemon's socket wins over XDG_RUNTIME_DIR, as in the CLI."""
    monkeypatch.delenv("GRAPHPOOL_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    monkeypatch.setattr(
        "graphpool.client.os.path.exists", lambda p: p == "/run/graphpool/graphpool.sock"
    )
    assert graphpool.default_socket_path() == "/run/graphpool/graphpool.sock"


def test_public_api_is_documented() -> None:
    """Every public class, function, method and property of the package has a docstring."""
    import importlib
    import inspect

    missing = []
    modules = ("client", "errors", "segments", "units", "schedule", "capture", "_shim", "snapshot")
    for modname in modules:
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
