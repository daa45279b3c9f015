"""The schedule-ordered baseline, from torch primitives only (what TE's `_order` path and Megatron do).

One forward and one backward CUDA graph per (layer, microbatch), captured in the order of the
schedule into ONE private pool on one stream; layer l's static output is layer l+1's static input,
output gradients chained the same way; parameter gradients accumulated into ``param.grad`` inside
the backward graphs; a microbatch's static buffers are given back to the pool after its backward
is captured (non-owning aliases are kept for replay), so later microbatches reuse them as eager
execution would. Capture order equals replay order, so one pool is safe here; the cost is a graph
count linear in the number of microbatches.
"""

from __future__ import annotations

from typing import Any

import torch


def _weak(t: torch.Tensor) -> torch.Tensor:
    st = torch._C._construct_storage_from_data_pointer(
        t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes()
    )
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(
        st, t.storage_offset(), t.shape, t.stride()
    )


class OrderedGraphs:
    def __init__(self, chunks: list[list[torch.nn.Module]], steps: list[Any], shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.chunks = chunks
        self.steps = steps
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        self.params = [[tuple(p for p in lay.parameters()) for lay in ch] for ch in chunks]
        for ch in self.params:
            for ps in ch:
                for p in ps:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
        self.fwd: dict[tuple[int, int], list[torch.cuda.CUDAGraph]] = {}
        self.bwd: dict[tuple[int, int], list[torch.cuda.CUDAGraph]] = {}
        self.static_in: dict[tuple[int, int], torch.Tensor] = {}
        self.static_gout: dict[tuple[int, int], torch.Tensor] = {}
        self.graphs = 0
        live: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # warm-up: one eager forward+backward per layer on the capture stream
            for ch in chunks:
                x = torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
                for lay in ch:
                    y = lay(x)
                    torch.autograd.grad(y, [x] + list(lay.parameters()), torch.ones_like(y))
                    x = y.detach().requires_grad_()
            del x, y
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            for st in steps:
                key = (st.chunk, st.microbatch)
                ch = chunks[st.chunk]
                if st.kind == "F":
                    graphs, saved = [], []
                    x = None
                    for lay in ch:
                        g = torch.cuda.CUDAGraph()
                        g.capture_begin(pool=pool)
                        if x is None:
                            x = torch.empty(shape, dtype=dtype, device="cuda").requires_grad_()
                        y = lay(x)
                        g.capture_end()
                        graphs.append(g)
                        saved.append((x, y))
                        x = y.detach().requires_grad_()
                    self.fwd[key] = graphs
                    live[key] = saved
                else:
                    saved = live.pop(key)
                    graphs = []
                    gout = None
                    for li in reversed(range(len(ch))):
                        x, y = saved[li]
                        ps = self.params[st.chunk][li]
                        g = torch.cuda.CUDAGraph()
                        g.capture_begin(pool=pool)
                        if gout is None:
                            gout = torch.empty_like(y)
                            self.static_gout[key] = _weak(gout)
                        grads = torch.autograd.grad(y, (x,) + ps, gout)
                        torch._foreach_add_([p.grad for p in ps], list(grads[1:]))
                        gout = grads[0]
                        del grads
                        g.capture_end()
                        graphs.append(g)
                    self.bwd[key] = graphs
                    self.static_in[key] = _weak(saved[0][0])
                    del saved, gout, x, y
                self.graphs += len(graphs)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run_step(self, inputs: list[list[torch.Tensor]], grads: list[list[torch.Tensor]]) -> None:
        for st in self.steps:
            key = (st.chunk, st.microbatch)
            if st.kind == "F":
                self.static_in[key].copy_(inputs[st.chunk][st.microbatch])
                for g in self.fwd[key]:
                    g.replay()
            else:
                self.static_gout[key].copy_(grads[st.chunk][st.microbatch])
                for g in self.bwd[key]:
                    g.replay()
