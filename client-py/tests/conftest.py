"""Fixtures: a real graphpoold (host backend: memfd segments, no GPU) on a temporary socket.

The daemon binary is ``$GRAPHPOOL_DAEMON_BIN`` or ``<repo>/target/debug/graphpoold``; when
neither exists it is built with ``cargo build --bins`` (which may wait on cargo's build lock).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import graphpool
from gp_helpers import Daemon, daemon_binary


@pytest.fixture(scope="session")
def daemon_bin() -> Path:
    return daemon_binary()


@pytest.fixture(scope="session")
def daemon(daemon_bin: Path) -> Iterator[Daemon]:
    """A host-backend daemon with two 1 GiB devices and no quotas."""
    d = Daemon(daemon_bin)
    yield d
    d.stop()


@pytest.fixture(scope="session")
def quota_daemon(daemon_bin: Path) -> Iterator[Daemon]:
    """A host-backend daemon whose ranks have a 64 MiB quota each."""
    d = Daemon(daemon_bin, config='[limits]\ndefault_rank_quota = "64MiB"\n')
    yield d
    d.stop()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[graphpool.Client]:
    c = daemon.client()
    yield c
    c.close()


@pytest.fixture
def job_id() -> str:
    """A job id no other test uses."""
    return f"test-{uuid.uuid4().hex[:12]}"
