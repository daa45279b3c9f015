"""A graphed layer (its module, its slots' graphs and static tensors) and how the callables and
samples split into model chunks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _is_tensor(x: Any) -> bool:
    """Whether ``x`` is a tensor (duck-typed, so that the checks of `refusals.py` need no torch)."""
    return all(hasattr(x, a) for a in ("shape", "dtype", "requires_grad", "detach"))


def _nbytes(t: "torch.Tensor") -> int:
    return int(t.numel() * t.element_size())


def _split_chunks(callables: Sequence[Any], v: int) -> list[list[Any]]:
    if v == 1:
        if callables and all(isinstance(c, (list, tuple)) for c in callables):
            if len(callables) != 1:
                raise ValueError("one model chunk expected: pass the layers as a flat sequence")
            return [list(callables[0])]
        return [list(callables)]
    if len(callables) == v and all(isinstance(c, (list, tuple)) for c in callables):
        return [list(c) for c in callables]
    if len(callables) % v:
        raise ValueError(
            f"{len(callables)} layers cannot be split evenly into {v} chunks: pass one "
            f"sequence of layers per chunk"
        )
    n = len(callables) // v
    return [list(callables[i * n : (i + 1) * n]) for i in range(v)]


def _chunk_samples(sample_args: Sequence[Any], chunks: list[list[Any]]) -> list[tuple[Any, ...]]:
    """The sample inputs of each chunk's first layer: a tuple per chunk, a tuple per layer (as
    torch's), or, for one chunk, a flat tuple of tensors (the first layer's inputs: ``(x,
    mask)`` for two layers is one sample of two inputs, not a sample per layer)."""
    total = sum(len(c) for c in chunks)
    v = len(chunks)
    if v == 1 and sample_args and not any(isinstance(a, (tuple, list)) for a in sample_args):
        return [tuple(sample_args)]  # the inputs of the one chunk's first layer, not one per layer
    if len(sample_args) == total and total != v:
        out, i = [], 0
        for c in chunks:
            out.append(_as_tuple(sample_args[i]))
            i += len(c)
        return out
    if len(sample_args) == v:
        return [_as_tuple(a) for a in sample_args]
    raise ValueError(
        f"sample_args: expected one tuple per layer ({total}) or per chunk ({v}), got "
        f"{len(sample_args)}"
    )


class _Layer:
    """The graphs and static buffers of one (chunk, layer), per slot."""

    def __init__(self, chunk: int, index: int, module: Any, nslots: int, first: bool, last: bool):
        self.chunk = chunk
        self.index = index
        self.module = module
        self.first = first
        self.last = last
        params = module.parameters() if hasattr(module, "parameters") else ()
        self.params: tuple[Any, ...] = tuple(p for p in params if p.requires_grad)
        self.fwd: list[Any] = [None] * nslots
        self.bwd: list[Any] = [None] * nslots
        self.static_in: list[tuple[Any, ...]] = [()] * nslots
        self.static_out: list[tuple[Any, ...]] = [()] * nslots
        self.static_gout: list[tuple[Any, ...]] = [()] * nslots  # aliases (weak)
        self.static_gin: list[tuple[Any, ...]] = [()] * nslots  # aliases (weak); None = no grad
        self.in_requires_grad: tuple[bool, ...] = ()
        self.out_requires_grad: tuple[bool, ...] = ()
        #: The layer returned one tensor, not a tuple or list (its callable returns the same).
        self.single_output = True
        #: Every output is an input or a view of one: the layer's graphs launch nothing.
        self.launches_nothing = False
        #: The module and its submodules, and ``training`` of each at capture (empty for a
        #: callable that is not a module): the graphs replay what the layer did in those modes
        #: (dropout, batch statistics).
        self.modes: tuple[tuple[Any, ...], tuple[bool, ...]] = _modes(module)
        self.grad_bufs: tuple[Any, ...] = ()
        #: A scalar that requires grad, passed to the replay Function so that autograd runs its
        #: backward even when no input requires grad (parameters are not Function inputs: their
        #: gradients are accumulated inside the backward graph).
        self.anchor: Any = None


def _modes(module: Any) -> tuple[tuple[Any, ...], tuple[bool, ...]]:
    """The module and its submodules, and the training mode of each."""
    modules = getattr(module, "modules", None)
    every = tuple(modules()) if callable(modules) else (module,)
    mods = tuple(m for m in every if isinstance(getattr(m, "training", None), bool))
    return mods, tuple(m.training for m in mods)


def _layer_buffers(lay: _Layer) -> list[tuple[str, Any]]:
    """The buffers of a layer's module by qualified name (none for a plain function)."""
    named = getattr(lay.module, "named_buffers", None)
    return list(named()) if callable(named) else []


def _snapshot_buffers(layers: list[list[_Layer]]) -> list[tuple[Any, Any]]:
    """``(buffer, copy of its value)`` of every buffer of the layers, each tensor once: what
    :func:`_restore_buffers` puts back after the warm-up."""
    import torch

    seen: set[int] = set()
    out = []
    with torch.no_grad():
        for ch in layers:
            for lay in ch:
                for _, t in _layer_buffers(lay):
                    if id(t) not in seen:
                        seen.add(id(t))
                        out.append((t, t.clone()))
    return out


def _restore_buffers(snapshot: list[tuple[Any, Any]]) -> None:
    """Undoes what the warm-up's forwards did to buffers updated in place (``BatchNorm``'s
    running statistics and batch count), so that capture leaves them as it found them and
    the replays update them as eager execution would."""
    import torch

    with torch.no_grad():
        for t, value in snapshot:
            t.copy_(value)
