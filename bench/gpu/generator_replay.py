"""What registering extra CUDA generators with a graph costs each replay (the price of
``make_graphed_callables(rng_generators=...)``, which registers them with every graph).

A one-kernel graph, with and without a dropout of the default generator, registered with 0, 1,
3 and 8 generators that it does not draw from; best of five runs of 2000 replays each.

    python3 bench/gpu/generator_replay.py
"""

from __future__ import annotations

import time

import torch


def _graph(x: torch.Tensor, stream: torch.cuda.Stream, generators: int, draw: bool) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    for _ in range(generators):
        g.register_generator_state(torch.Generator(device="cuda"))
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        g.capture_begin()
        x.mul_(1.0)
        if draw:
            torch.nn.functional.dropout(x, 0.5, True)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return g


def main() -> None:
    x = torch.ones(1024, device="cuda")
    stream = torch.cuda.Stream()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for draw in (False, True):
        for generators in (0, 1, 3, 8):
            g = _graph(x, stream, generators, draw)
            for _ in range(200):
                g.replay()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(2000):
                    g.replay()
                torch.cuda.synchronize()
                best = min(best, (time.perf_counter() - t) / 2000 * 1e6)
            kind = "dropout of the default generator" if draw else "no random op"
            print(f"{kind:34s} {generators} registered: {best:6.2f} us per replay")


if __name__ == "__main__":
    main()
