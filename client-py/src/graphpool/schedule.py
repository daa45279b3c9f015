"""Pipeline schedules: the order in which one pipeline rank runs forward and backward steps.

A :class:`Schedule` is the sequence of steps one rank of a pipeline-parallel job executes, and
from it everything schedule-aware capture needs: how many microbatches of each model chunk are
in flight at most, and which *buffer slot* each microbatch uses.

Conventions (shared with the daemon's planner and TransformerEngine's ``_order``):

* chunks are 1-based in an explicit order (``+c`` is the forward of chunk ``c`` of that chunk's
  next microbatch, ``-c`` its backward) and 0-based everywhere else (:class:`Step.chunk`);
* the n-th forward of a chunk is its microbatch n, and so is its n-th backward (backwards of a
  chunk run in the order of their forwards, as in every 1F1B variant);
* a microbatch takes a slot of its chunk at its forward and gives it back when its backward is
  done; a forward takes the lowest free slot. The number of slots of a chunk is the most
  microbatches of that chunk in flight at once, so no schedule order can need more.

This module imports neither torch nor the generated protobuf stubs at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Sequence

__all__ = ["Schedule", "ScheduleError", "Step"]


class ScheduleError(ValueError):
    """A schedule description is invalid (bad sizes, or an explicit order that cannot run)."""


@dataclass(frozen=True)
class Step:
    """One step of a schedule: the forward or backward of one microbatch of one chunk."""

    #: ``"F"`` for a forward, ``"B"`` for a backward.
    kind: Literal["F", "B"]
    #: Model chunk, 0-based.
    chunk: int
    #: Microbatch index within the chunk, 0-based.
    microbatch: int
    #: Buffer slot of this microbatch within its chunk, 0-based.
    slot: int

    @property
    def signed(self) -> int:
        """The step as a signed 1-based chunk number (``+c`` forward, ``-c`` backward)."""
        return self.chunk + 1 if self.kind == "F" else -(self.chunk + 1)

    @property
    def is_forward(self) -> bool:
        """True for a forward step, False for a backward."""
        return self.kind == "F"


def _index(name: str, value: int, length: int) -> int:
    """``value`` as an index into ``length`` items; negative indices do not wrap around."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if not 0 <= value < length:
        raise IndexError(f"{name} must be between 0 and {length - 1}, got {value}")
    return value


def _positive(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ScheduleError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class Schedule:
    """The step order of one pipeline rank, with slot assignment.

    Build one with :meth:`one_f_one_b`, :meth:`interleaved` or :meth:`explicit`.
    """

    #: ``"1f1b"``, ``"interleaved"`` or ``"explicit"``.
    kind: str
    num_microbatches: int
    virtual_chunks: int
    #: Signed 1-based step order (``+c`` forward of chunk c, ``-c`` backward).
    order: tuple[int, ...]
    pp_size: int = 0
    pp_rank: int = 0
    _steps: tuple[Step, ...] = field(default=(), repr=False, compare=False)
    _slots: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _mb_slot: tuple[tuple[int, ...], ...] = field(default=(), repr=False, compare=False)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def one_f_one_b(cls, pp_size: int, pp_rank: int, num_microbatches: int) -> "Schedule":
        """Non-interleaved 1F1B (PipeDream-flush) for rank ``pp_rank`` of ``pp_size``.

        ``min(pp_size - pp_rank - 1, M)`` warm-up forwards, then alternating forward/backward,
        then the remaining backwards. Stage 0 of 8 with M = 8 has 8 microbatches in flight; the
        last stage has 1.
        """
        _positive("pp_size", pp_size)
        _positive("pp_rank", pp_rank, 0)
        _positive("num_microbatches", num_microbatches)
        if pp_rank >= pp_size:
            raise ScheduleError(f"pp_rank must be < pp_size ({pp_size}), got {pp_rank}")
        m = num_microbatches
        warmup = min(pp_size - pp_rank - 1, m)
        order = [1] * warmup
        for _ in range(m - warmup):
            order += [1, -1]
        order += [-1] * warmup
        return cls._build("1f1b", order, m, 1, pp_size, pp_rank)

    @classmethod
    def interleaved(
        cls, pp_size: int, pp_rank: int, num_microbatches: int, virtual_chunks: int
    ) -> "Schedule":
        """Interleaved 1F1B (Megatron-LM) with ``virtual_chunks`` model chunks per rank.

        Microbatches go through the chunks in groups of ``pp_size`` (the last group may be
        shorter): with M a multiple of pp_size, forward step k runs chunk ``(k // pp_size) % V``
        and backward step k chunk ``V - 1 - (k // pp_size) % V``. Warm-up:
        ``2 (pp_size - pp_rank - 1) + (V - 1) pp_size`` forwards (capped at M V). Needs
        ``num_microbatches >= pp_size``. The same model as the daemon's planner.
        """
        _positive("pp_size", pp_size)
        _positive("pp_rank", pp_rank, 0)
        _positive("num_microbatches", num_microbatches)
        _positive("virtual_chunks", virtual_chunks)
        if pp_rank >= pp_size:
            raise ScheduleError(f"pp_rank must be < pp_size ({pp_size}), got {pp_rank}")
        v, p, m = virtual_chunks, pp_size, num_microbatches
        if v == 1:
            s = cls.one_f_one_b(p, pp_rank, m)
            return cls._build("interleaved", list(s.order), m, 1, p, pp_rank)
        if m < p:
            raise ScheduleError(
                f"interleaved 1F1B needs at least pp_size = {p} microbatches, got {m}"
            )
        # Megatron's table: microbatches in groups of pp_size (the last group may be shorter),
        # each group through chunk 0, 1, ..., V-1.
        table: list[int] = []  # chunk of each virtual microbatch
        lo = 0
        while lo < m:
            hi = min(lo + p, m)
            for c in range(v):
                table.extend([c] * (hi - lo))
            lo = hi
        total = m * v
        warmup = min((p - pp_rank - 1) * 2 + (v - 1) * p, total)

        def fwd_chunk(k: int) -> int:
            return table[k]

        def bwd_chunk(k: int) -> int:
            return v - 1 - table[k]

        order: list[int] = [fwd_chunk(k) + 1 for k in range(warmup)]
        for k in range(total - warmup):
            order.append(fwd_chunk(k + warmup) + 1)
            order.append(-(bwd_chunk(k) + 1))
        for k in range(total - warmup, total):
            order.append(-(bwd_chunk(k) + 1))
        return cls._build("interleaved", order, m, v, p, pp_rank)

    @classmethod
    def explicit(
        cls, order: Sequence[int], num_microbatches: int, virtual_chunks: int = 1
    ) -> "Schedule":
        """An explicit order: ``+c`` forward of chunk c (1-based), ``-c`` its backward.

        Every chunk must have exactly ``num_microbatches`` forwards and as many backwards, and
        a chunk's n-th backward must come after its n-th forward.
        """
        _positive("num_microbatches", num_microbatches)
        _positive("virtual_chunks", virtual_chunks)
        return cls._build("explicit", list(order), num_microbatches, virtual_chunks, 0, 0)

    @classmethod
    def _build(
        cls, kind: str, order: list[int], m: int, v: int, pp_size: int, pp_rank: int
    ) -> "Schedule":
        steps, slots, mb_slot = _assign(order, m, v)
        return cls(
            kind=kind,
            num_microbatches=m,
            virtual_chunks=v,
            order=tuple(order),
            pp_size=pp_size,
            pp_rank=pp_rank,
            _steps=tuple(steps),
            _slots=tuple(slots),
            _mb_slot=tuple(tuple(x) for x in mb_slot),
        )

    # ------------------------------------------------------------------ queries

    @property
    def steps(self) -> tuple[Step, ...]:
        """Every step in order, with its chunk, microbatch and slot."""
        return self._steps

    def __iter__(self) -> Iterator[Step]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def slots_per_chunk(self) -> tuple[int, ...]:
        """Buffer slots of each chunk: the most microbatches of that chunk in flight at once."""
        return self._slots

    @property
    def num_slots(self) -> int:
        """Buffer slots over all chunks."""
        return sum(self._slots)

    def max_in_flight(self, chunk: int | None = None) -> int:
        """Most microbatches in flight at once, of one chunk (0-based) or of all together."""
        if chunk is not None:
            return self._slots[_index("chunk", chunk, len(self._slots))]
        live = best = 0
        for s in self._steps:
            live += 1 if s.kind == "F" else -1
            best = max(best, live)
        return best

    def in_flight_after_each_step(self) -> list[int]:
        """Microbatches in flight (all chunks) after each step."""
        out, live = [], 0
        for s in self._steps:
            live += 1 if s.kind == "F" else -1
            out.append(live)
        return out

    def slot_of(self, chunk: int, microbatch: int) -> int:
        """Slot of ``microbatch`` (0-based) of ``chunk`` (0-based).

        Raises:
            IndexError: ``chunk`` or ``microbatch`` is out of range (negative included).
            TypeError: either is not an integer.
        """
        slots = self._mb_slot[_index("chunk", chunk, len(self._mb_slot))]
        return slots[_index("microbatch", microbatch, len(slots))]

    def microbatch_slots(self, chunk: int = 0) -> list[int]:
        """Slot of each microbatch of ``chunk``, indexed by microbatch."""
        return list(self._mb_slot[_index("chunk", chunk, len(self._mb_slot))])

    def first_use_steps(self) -> list[Step]:
        """The steps that first use each (kind, chunk, slot): what capture has to record."""
        seen: set[tuple[str, int, int]] = set()
        out = []
        for s in self._steps:
            key = (s.kind, s.chunk, s.slot)
            if key not in seen:
                seen.add(key)
                out.append(s)
        return out

    def describe(self) -> str:
        """A one-line description for logs and errors, e.g. ``"1F1B stage 0 of 8, M=128,
        slots=[8]"``."""
        name = {
            "1f1b": f"1F1B stage {self.pp_rank} of {self.pp_size}",
            "interleaved": (
                f"interleaved 1F1B stage {self.pp_rank} of {self.pp_size}, "
                f"{self.virtual_chunks} chunks"
            ),
            "explicit": f"explicit order, {self.virtual_chunks} chunks",
        }[self.kind]
        return f"{name}, M={self.num_microbatches}, slots={list(self._slots)}"

    # ------------------------------------------------------------------ proto

    def to_dict(self) -> dict[str, Any]:
        """The schedule as the JSON/TOML ``schedule`` table of ``graphpool plan --schedule``."""
        if self.kind == "1f1b":
            return {"one_f_one_b": {"pp_size": self.pp_size, "pp_rank": self.pp_rank,
                                    "num_microbatches": self.num_microbatches}}
        if self.kind == "interleaved":
            return {"interleaved": {"pp_size": self.pp_size, "pp_rank": self.pp_rank,
                                    "num_microbatches": self.num_microbatches,
                                    "virtual_chunks": self.virtual_chunks}}
        return {"explicit": {"order": list(self.order), "num_microbatches": self.num_microbatches,
                             "virtual_chunks": self.virtual_chunks}}

    def to_proto(self) -> Any:
        """The ``graphpool.v1.Schedule`` message for this schedule (needs protobuf)."""
        from graphpool._proto.graphpool.v1 import plan_pb2

        if self.kind == "1f1b":
            return plan_pb2.Schedule(
                one_f_one_b=plan_pb2.OneFOneB(
                    pp_size=self.pp_size,
                    pp_rank=self.pp_rank,
                    num_microbatches=self.num_microbatches,
                )
            )
        if self.kind == "interleaved":
            return plan_pb2.Schedule(
                interleaved=plan_pb2.Interleaved(
                    pp_size=self.pp_size,
                    pp_rank=self.pp_rank,
                    num_microbatches=self.num_microbatches,
                    virtual_chunks=self.virtual_chunks,
                )
            )
        return plan_pb2.Schedule(
            explicit_order=plan_pb2.ExplicitOrder(
                order=list(self.order),
                num_microbatches=self.num_microbatches,
                virtual_chunks=self.virtual_chunks,
            )
        )

    @classmethod
    def from_proto(cls, msg: Any) -> "Schedule":
        """The inverse of :meth:`to_proto`."""
        which = msg.WhichOneof("kind")
        if which == "one_f_one_b":
            x = msg.one_f_one_b
            return cls.one_f_one_b(x.pp_size, x.pp_rank, x.num_microbatches)
        if which == "interleaved":
            x = msg.interleaved
            return cls.interleaved(x.pp_size, x.pp_rank, x.num_microbatches, x.virtual_chunks)
        if which == "explicit_order":
            x = msg.explicit_order
            return cls.explicit(list(x.order), x.num_microbatches, x.virtual_chunks or 1)
        raise ScheduleError("Schedule message has no kind set")


def _counted(n: int, noun: str) -> str:
    """``n`` and ``noun`` in the number ``n`` asks for: "1 forward", "2 forwards"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _assign(
    order: Sequence[int], m: int, v: int
) -> tuple[list[Step], list[int], list[list[int]]]:
    """Validate an order and assign microbatches and slots (lowest free slot at a forward)."""
    fwd = [0] * v
    bwd = [0] * v
    free: list[list[int]] = [[] for _ in range(v)]  # per chunk, sorted free slots
    nslots = [0] * v
    mb_slot: list[list[int]] = [[-1] * m for _ in range(v)]
    steps: list[Step] = []
    for i, x in enumerate(order):
        if isinstance(x, bool) or not isinstance(x, int) or x == 0:
            raise ScheduleError(f"order[{i}] = {x!r}: entries must be non-zero integers")
        c = abs(x) - 1
        if c >= v:
            raise ScheduleError(
                f"order[{i}] = {x}: chunk {abs(x)} out of range 1..{v} (virtual_chunks={v})"
            )
        if x > 0:
            mb = fwd[c]
            if mb >= m:
                raise ScheduleError(
                    f"order[{i}] = {x}: chunk {c + 1} already has {_counted(m, 'forward')} "
                    f"(num_microbatches={m})"
                )
            fwd[c] += 1
            if free[c]:
                slot = free[c].pop(0)
            else:
                slot = nslots[c]
                nslots[c] += 1
            mb_slot[c][mb] = slot
            steps.append(Step("F", c, mb, slot))
        else:
            mb = bwd[c]
            if mb >= fwd[c]:
                raise ScheduleError(
                    f"order[{i}] = {x}: backward of microbatch {mb} of chunk {c + 1} before "
                    f"its forward"
                )
            bwd[c] += 1
            slot = mb_slot[c][mb]
            free[c].append(slot)
            free[c].sort()
            steps.append(Step("B", c, mb, slot))
    for c in range(v):
        if fwd[c] != m or bwd[c] != m:
            raise ScheduleError(
                f"chunk {c + 1} has {_counted(fwd[c], 'forward')} and "
                f"{_counted(bwd[c], 'backward')}; each must be "
                f"num_microbatches={m}"
            )
    return steps, nslots, mb_slot
