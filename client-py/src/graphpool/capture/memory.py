"""Where captured graphs' memory comes from: daemon-backed or plain torch pools, and raw views
of it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, cast, Iterable

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("graphpool.capture")


def _alias(t: "torch.Tensor") -> "torch.Tensor":
    """A tensor over ``t``'s memory that does not keep that memory allocated.

    The caching allocator may hand the block to later allocations of the same pool; callers only
    use the alias where the schedule guarantees the memory holds what they expect.
    """
    import torch

    nbytes = t.untyped_storage().nbytes()
    base = t.untyped_storage().data_ptr()
    st = _storage_at(base, nbytes, t.device)
    out = torch.empty((0,), dtype=t.dtype, device=t.device)
    cast(Any, out).set_(st, t.storage_offset(), t.shape, t.stride())
    return out


def _storage_at(ptr: int, nbytes: int, device: "torch.device") -> Any:
    """An untyped storage over ``[ptr, ptr + nbytes)`` that owns nothing."""
    import torch

    ctor = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if ctor is not None:
        return ctor(ptr, device, nbytes)

    class _CAI:  # fallback through the CUDA array interface (the deleter drops this object)
        __cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }

    return torch.as_tensor(_CAI(), device=device).untyped_storage()


#: The values of ``make_graphed_callables(pools=...)``.
POOL_KINDS = ("auto", "graphpool", "torch")


def _daemon_pool_factory(
    device: int, budget: int | None, client: Any, *, required: bool = False
) -> Callable[[str], Any] | None:
    """A factory of daemon-backed pools, or None when graphpool's MemPool, its native shim or a
    daemon is absent (``ImportError``, ``FileNotFoundError`` for the shim,
    ``DaemonUnavailable``). Any other failure of the probe (the daemon refusing this process,
    a malformed argument, a reserved budget that does not fit, ...) is raised: falling back to
    torch pools would bypass the daemon's refusal. With ``required`` (``pools="graphpool"``),
    absence is raised too."""
    try:
        from graphpool import torch as gp_torch  # the daemon-backed MemPool
        from graphpool.errors import DaemonUnavailable

        cls = getattr(gp_torch, "MemPool")
    except ImportError as e:
        if required:
            raise
        log.info("graphpool.torch.MemPool not available (%s); using torch.cuda.MemPool", e)
        return None

    def make(label: str) -> Any:
        # the session budget: the capture's, or none (MemPool's default of 8 GiB would refuse
        # captures larger than that although no budget was asked for)
        kwargs: dict[str, Any] = {"device": device, "budget": budget or None}
        if client is not None:  # a Client, or a Session: the socket of its Client
            kwargs["client"] = _session_client(client) or client
        try:
            return cls(label=label, **kwargs)
        except TypeError:
            return cls(**kwargs)

    try:  # one probe: is a daemon reachable?
        probe = make("graphpool-capture-probe")
    except (DaemonUnavailable, FileNotFoundError, ImportError) as e:
        if required:
            raise
        log.info("graphpoold or its shim not available (%s); using torch.cuda.MemPool", e)
        return None
    first = [probe]

    def factory(label: str) -> Any:
        if first:
            return first.pop()
        return make(label)

    return factory


def _pool_id(pool: Any) -> Any:
    return pool.id


def _session_client(client: Any) -> Any:
    """The ``graphpool.Client`` of ``client`` when it is a ``graphpool.Session``, else None."""
    if hasattr(client, "session_id") and hasattr(client, "client"):
        return client.client
    return None


def _release_pools(pools: Iterable[Any]) -> list[Exception]:
    """Releases each distinct daemon-backed pool (``graphpool.torch.MemPool``; torch's own have
    no ``release``), every one even when one fails; returns the failures in order."""
    seen: set[int] = set()
    errors: list[Exception] = []
    for pool in pools:
        if id(pool) in seen:
            continue
        seen.add(id(pool))
        release = getattr(pool, "release", None)
        if release is not None:
            try:
                release()
            except Exception as e:  # noqa: BLE001 - the other pools must be given back all the same
                errors.append(e)
    return errors


def _same_memory(a: Any, b: Any) -> bool:
    """Whether tensor ``a`` is ``b``'s memory in ``b``'s layout (then there is nothing to copy:
    the previous layer's static output, or the next layer's static input gradient, as the
    capture chained them)."""
    return bool(a.data_ptr() == b.data_ptr() and a.stride() == b.stride())


def _outside(free_before: int, reserved_before: int, device: int) -> int:
    """Device memory taken since ``free_before`` beyond the allocator's reserve growth."""
    import torch

    took = free_before - torch.cuda.mem_get_info(device)[0]
    return max(0, int(took - (torch.cuda.memory_reserved(device) - reserved_before)))


_LARGE = 1 << 20  # the caching allocator's small/large block boundary


def _round512(n: int) -> int:
    return (n + 511) // 512 * 512


def _give_arena(pool: Any, nbytes: int, stream: Any, device: int) -> None:
    """Makes the caching allocator take one segment of ``nbytes`` for ``pool`` (on the capture
    stream, whose blocks capture allocations may use) and leaves it free in the pool: capture
    then splits its large tensors out of it instead of rounding each 1-10 MiB tensor into a
    20 MiB segment of its own."""
    import torch

    if nbytes <= 20 << 20:
        return
    tp = getattr(pool, "torch_pool", pool)
    with torch.cuda.stream(stream), torch.cuda.use_mem_pool(tp, device=device):
        t = torch.empty((nbytes,), dtype=torch.uint8, device=torch.device("cuda", device))
        del t
