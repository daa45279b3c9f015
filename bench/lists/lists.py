#!/usr/bin/env python3
"""Buffer lists drawn independently of the planner's own generators.

The planner's figures (`cargo run -p graphpool-planner --example figures`) come from
`workload.rs`, whose generators were written next to the planner. This script draws lists
from other distributions, with its own random numbers, and writes them in the format of
`graphpool plan --buffers` (CSV, header `buffer,start,end,size`, live over [start, end)), so
that the planner can be checked on inputs it was not tuned on:

* random families: sizes log-normal, Pareto, a few multiples of 1 MiB, 256-byte multiples,
  powers of two, powers of two and three quarters of them, log-uniform over twelve octaves;
  lifetimes exponential, Pareto, powers of two, uniform; arrivals uniform, in bursts or
  eight a step, or over n / 100 steps (`few-steps`: a coarse clock);
* guillotine tilings of a 4 GiB x (4 n steps) rectangle (cuts at 512-byte multiples), whose
  optimum footprint is the lower bound: mostly time cuts, mostly memory cuts, cuts near the
  middle of a piece, always the largest piece cut, and memory cut at eighths (sizes repeat);
  and over n / 100 steps instead (`tiling-short`: most pieces live one step, tens of them
  start at every step).

    python3 bench/lists/lists.py --out DIR [--sizes 10000,100000] [--seeds 1-3]
                                 [--families lognormal,tiling-time70,...] [--offsets]

With `--offsets`, the tilings' files get an `offset` column as well: each piece's place in
its rectangle, a placement at the lower bound that `graphpool plan --buffers` checks and
reports beside its own plan ("given offsets"). Random families have no known optimum and
get no such column.

`bench/lists/run.sh` draws them and plans each with `graphpool plan`.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import random
import sys
from pathlib import Path
from typing import Callable

# (start, end, size): one buffer live over [start, end).
Buffer = tuple[int, int, int]
# (start, end, offset, size): one piece of a tiling.
Piece = tuple[int, int, int, int]
# (start, end, size, offset): one line of a list; the offset where a placement is known.
Row = tuple[int, int, int, int | None]

MIB = 1 << 20
TILING_HEIGHT = 1 << 32
TILING_UNIT = 512


def lognormal(n: int, rng: random.Random) -> list[Buffer]:
    """Log-normal sizes (median ~440 KiB), exponential lifetimes (mean 50 steps)."""
    out = []
    for _ in range(n):
        start = rng.randrange(n)
        size = int(min(256 * MIB, max(256, rng.lognormvariate(13, 2))))
        out.append((start, start + 1 + int(rng.expovariate(1 / 50)), size))
    return out


def pareto(n: int, rng: random.Random) -> list[Buffer]:
    """Pareto sizes from 4 KiB and lifetimes from one step: a few huge and long-lived."""
    out = []
    for _ in range(n):
        start = rng.randrange(n)
        life = min(5000, int(rng.paretovariate(1.2)))
        size = min(128 * MIB, int(4096 * rng.paretovariate(1.1)))
        out.append((start, start + max(1, life), size))
    return out


def layers(n: int, rng: random.Random) -> list[Buffer]:
    """Ten sizes of 1-32 MiB, lifetimes of 1-1024 steps in powers of two (layer-like)."""
    sizes = [k * MIB for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)]
    lives = [1, 2, 4, 8, 16, 64, 256, 1024]
    out = []
    for _ in range(n):
        start = rng.randrange(n)
        out.append((start, start + rng.choice(lives), rng.choice(sizes)))
    return out


def bursts(n: int, rng: random.Random) -> list[Buffer]:
    """Arrivals in bursts every 100 steps, lifetimes of 1-300 steps, sizes 1 B-4 MiB."""
    out = []
    for _ in range(n):
        start = rng.randrange(max(1, n // 100)) * 100 + int(rng.expovariate(1 / 3))
        out.append((start, start + 1 + rng.randrange(300), rng.randrange(1, 4 * MIB)))
    return out


def busy_powers(n: int, rng: random.Random) -> list[Buffer]:
    """Sizes of 2^k bytes (k 9-30), eight arrivals a step, lifetimes of 1-63 steps: a third
    of the buffers end where one of their size starts, by chance."""
    out = []
    steps = max(1, n // 8)
    for _ in range(n):
        start = rng.randrange(steps)
        out.append((start, start + rng.randint(1, 63), 1 << rng.randint(9, 30)))
    return out


def quarters(n: int, rng: random.Random) -> list[Buffer]:
    """26 sizes: powers of two of 4 KiB-16 MiB and three quarters of each, lifetimes of
    1-1000 steps (about 500 live), starts uniform."""
    out = []
    for _ in range(n):
        start = rng.randrange(n)
        size = (4096 << rng.randrange(13)) // 4 * rng.choice((3, 4))
        out.append((start, start + rng.randint(1, 1000), size))
    return out


def log_busy(n: int, rng: random.Random) -> list[Buffer]:
    """Log-uniform sizes of 4 KiB-16 MiB (any byte), lifetimes of 1-1000 steps (about 500
    live), starts uniform."""
    out = []
    for _ in range(n):
        start = rng.randrange(n)
        out.append((start, start + rng.randint(1, 1000), int(4096 * 2 ** (12 * rng.random()))))
    return out


def few_steps(n: int, rng: random.Random) -> list[Buffer]:
    """Log-uniform sizes of 4 KiB-16 MiB, lifetimes log-uniform over 1-32 steps, starts
    uniform over n / 100 steps (at least 16): a trace whose clock is coarse (a step per layer
    or per kernel launch), about a hundred buffers starting at every step."""
    steps = max(16, n // 100)
    out = []
    for _ in range(n):
        start = rng.randrange(steps)
        life = int(2 ** (5 * rng.random()))
        out.append((start, start + life, int(4096 * 2 ** (12 * rng.random()))))
    return out


def aligned(n: int, rng: random.Random) -> list[Buffer]:
    """256-byte multiples up to 1 MiB, lifetimes of 1-1999 steps (about 1000 live)."""
    out = []
    for _ in range(n):
        start = rng.randrange(n)
        out.append((start, start + rng.randrange(1, 2000), 256 * rng.randrange(1, 4096)))
    return out


def guillotine(
    n: int, rng: random.Random, time_share: float, middle: bool, horizon: int | None = None
) -> list[Piece]:
    """A random piece is cut `n - 1` times: in time with probability `time_share`, else in
    memory; at a uniform place, or near the middle (triangular) when `middle`; over
    `horizon` steps (default 4 n)."""

    def in_time(s: int, e: int) -> int:
        return round(rng.triangular(s + 1, e - 1)) if middle else rng.randint(s + 1, e - 1)

    def in_memory(h: int) -> int | None:
        units = h // TILING_UNIT
        if units < 2:
            return None
        c = round(rng.triangular(1, units - 1)) if middle else rng.randint(1, units - 1)
        return c * TILING_UNIT

    return cut_at_random(n, rng, time_share, in_time, in_memory, horizon)


def eighths(n: int, rng: random.Random) -> list[Piece]:
    """A random piece is cut `n - 1` times, in time or memory (uniformly): in time at a
    uniform place, in memory at a multiple of an eighth of its bytes where that is a whole
    number of units (else at half, else not): sizes repeat, so many pieces ending and
    starting at a step add up alike."""

    def in_memory(h: int) -> int | None:
        if h % (8 * TILING_UNIT) == 0:
            return rng.randint(1, 7) * (h // 8)
        if h % (2 * TILING_UNIT) == 0:
            return h // 2
        return None

    return cut_at_random(n, rng, 0.5, lambda s, e: rng.randint(s + 1, e - 1), in_memory)


def cut_at_random(
    n: int,
    rng: random.Random,
    time_share: float,
    in_time: Callable[[int, int], int],
    in_memory: Callable[[int], int | None],
    horizon: int | None = None,
) -> list[Piece]:
    """The tiling of a 4 GiB x `horizon` steps (default 4 n) rectangle cut `n - 1` times: a
    random piece, in time with probability `time_share` (where it spans two steps or more) at
    the step `in_time(start, end)` gives, else in memory at the byte `in_memory(size)` gives
    (none: not cut)."""
    pieces: list[Piece] = [(0, horizon or 4 * n, 0, TILING_HEIGHT)]
    attempts = 0
    while len(pieces) < n and attempts < 64 * n:
        attempts += 1
        k = rng.randrange(len(pieces))
        s, e, o, h = pieces[k]
        if rng.random() < time_share:
            if e - s < 2:
                continue
            c = in_time(s, e)
            pieces[k] = (s, c, o, h)
            pieces.append((c, e, o, h))
        else:
            cut = in_memory(h)
            if cut is None:
                continue
            pieces[k] = (s, e, o, cut)
            pieces.append((s, e, o + cut, h - cut))
    return pieces


def largest_first(n: int, rng: random.Random) -> list[Piece]:
    """The piece of most bytes x steps is cut each time (in time or memory, uniformly)."""
    horizon = 4 * n
    # (-area, tie-break, piece); pieces that cannot be cut go to `done`.
    heap: list[tuple[int, int, Piece]] = [(-horizon * TILING_HEIGHT, 0, (0, horizon, 0, TILING_HEIGHT))]
    done: list[Piece] = []
    count = 0
    while heap and len(heap) + len(done) < n:
        _, _, (s, e, o, h) = heapq.heappop(heap)
        halves: list[Piece]
        if rng.random() < 0.5 and e - s >= 2:
            c = rng.randint(s + 1, e - 1)
            halves = [(s, c, o, h), (c, e, o, h)]
        elif h >= 2 * TILING_UNIT:
            c = rng.randint(1, h // TILING_UNIT - 1) * TILING_UNIT
            halves = [(s, e, o, c), (s, e, o + c, h - c)]
        else:
            done.append((s, e, o, h))
            continue
        for piece in halves:
            count += 1
            heapq.heappush(heap, (-(piece[1] - piece[0]) * piece[3], count, piece))
    return done + [piece for _, _, piece in heap]


def tiling(draw: Callable[[int, random.Random], list[Piece]]) -> Callable[[int, random.Random], list[Row]]:
    """The pieces of a tiling `draw` makes, checked to tile their rectangle, shuffled, each
    with its offset in the rectangle."""

    def rows(n: int, rng: random.Random) -> list[Row]:
        pieces = draw(n, rng)
        check_tiling(pieces)
        rng.shuffle(pieces)
        return [(s, e, size, offset) for s, e, offset, size in pieces]

    return rows


def unplaced(draw: Callable[[int, random.Random], list[Buffer]]) -> Callable[[int, random.Random], list[Row]]:
    """The buffers `draw` makes, with no known placement."""
    return lambda n, rng: [(s, e, size, None) for s, e, size in draw(n, rng)]


def check_tiling(pieces: list[Piece]) -> None:
    """Raises ValueError unless every step of the rectangle has exactly its height live."""
    horizon = max(e for _, e, _, _ in pieces)
    delta = [0] * (horizon + 1)
    for s, e, _, size in pieces:
        delta[s] += size
        delta[e] -= size
    live = 0
    for t in range(horizon):
        live += delta[t]
        if live != TILING_HEIGHT:
            raise ValueError(f"not a tiling: {live} bytes live at step {t}")


FAMILIES: dict[str, Callable[[int, random.Random], list[Row]]] = {
    "lognormal": unplaced(lognormal),
    "pareto": unplaced(pareto),
    "layers": unplaced(layers),
    "bursts": unplaced(bursts),
    "aligned": unplaced(aligned),
    "busy-pow2": unplaced(busy_powers),
    "pow2-quarters": unplaced(quarters),
    "log-busy": unplaced(log_busy),
    "few-steps": unplaced(few_steps),
    "tiling-time70": tiling(lambda n, rng: guillotine(n, rng, 0.7, False)),
    "tiling-memory70": tiling(lambda n, rng: guillotine(n, rng, 0.3, False)),
    "tiling-middle": tiling(lambda n, rng: guillotine(n, rng, 0.5, True)),
    "tiling-largest": tiling(largest_first),
    "tiling-eighths": tiling(eighths),
    "tiling-short": tiling(lambda n, rng: guillotine(n, rng, 0.5, False, max(16, n // 100))),
}


def seed_range(text: str) -> range:
    """`A-B` (inclusive) or `A`."""
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the CSV files")
    parser.add_argument("--sizes", default="10000,100000", help="buffers per list, comma-separated")
    parser.add_argument("--seeds", default="1-3", help="seeds, A-B inclusive")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated: " + ", ".join(FAMILIES))
    parser.add_argument(
        "--offsets",
        action="store_true",
        help="write each tiling piece's offset in its rectangle (a placement at the lower bound)",
    )
    args = parser.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if any(n < 2 for n in sizes):
        parser.error("--sizes: at least 2 buffers per list")
    args.out.mkdir(parents=True, exist_ok=True)
    for family in families:
        for n in sizes:
            for seed in seed_range(args.seeds):
                # Each list draws from its own stream: a family, size and seed name one list.
                rng = random.Random(f"{family}/{n}/{seed}")
                path = args.out / f"{family}-{n}-{seed}.csv"
                rows = FAMILIES[family](n, rng)
                placed = args.offsets and all(offset is not None for *_, offset in rows)
                with path.open("w", newline="") as f:
                    writer = csv.writer(f)
                    writer.writerow(["buffer", "start", "end", "size"] + (["offset"] if placed else []))
                    for i, (start, end, size, offset) in enumerate(rows):
                        writer.writerow([f"b{i}", start, end, size] + ([offset] if placed else []))
                print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
