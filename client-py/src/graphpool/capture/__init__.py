"""Schedule-aware CUDA graph capture: one graph per (layer, slot), not per (layer, microbatch).

:func:`make_graphed_callables` is a drop-in for :func:`torch.cuda.make_graphed_callables` plus a
pipeline :class:`~graphpool.schedule.Schedule`. It returns a :class:`GraphedSchedule`: one callable
per (layer, microbatch) that the training loop calls in its usual order. Microbatches that share a
buffer slot replay the *same* two graphs, so the number of graphs is ``2 x layers x slots`` for any
number of microbatches.

Why this is safe (see ``docs/capture.md``). A graph replays at fixed addresses, and one graph now
serves many microbatches whose replays interleave differently from the captures. Memory is
therefore split by lifetime, one memory pool per lifetime class:

* **one forward pool per (chunk, slot)**: everything the forward graphs of that slot allocate —
  the slot's static input, every layer's static output (the next layer's static input), the
  tensors each forward keeps for its backward, and the forward temporaries. Only the graphs of
  that slot ever touch that pool, and a slot is held by one microbatch from its first forward to
  its last backward, so nothing can overwrite what a forward left for its backward;
* **one backward pool shared by every backward graph**: backward temporaries and the chained
  gradient buffers (layer l's input gradient is layer l-1's output gradient), which are dead as
  soon as the next backward graph of the same microbatch has read them. Backward graphs run one
  at a time on one stream, so sharing their temporaries is safe;
* **parameter gradients** are accumulated inside the backward graphs into ``param.grad``, which
  lives outside every pool (allocated before capture, as eager's first backward would).

The gradient with respect to a chunk's input (what a pipeline sends to the previous stage) is
copied out of the backward pool before it is handed to autograd, so a caller may keep it.

At run time each slot records which microbatch holds it; calling a microbatch out of an order
the schedule allows (its slot still held by another microbatch) raises instead of replaying.

Layers it supports (each checked; what it cannot graph is refused with :class:`UnsupportedLayer`,
naming the layer and what to change, before any graph is used):

* any number of tensor inputs and outputs: a layer returns a tensor or a tuple (or list) of
  tensors, which are the next layer's positional inputs, in order (the layers of a chunk are
  captured as a chain, the next layer's static input being this layer's static output: at run
  time a layer that is not its chunk's first must be called with the previous layer's outputs
  exactly as its callable returned them, anything else is refused with
  :class:`~graphpool.errors.InvalidArgument`; work between two layers belongs inside a layer).
  Inputs and outputs of any dtype and shape, and any mix of them (integer token ids, boolean or
  float masks, bf16 and fp32, a width that changes from layer to layer, a scalar loss); an
  output may be the very tensor the layer received, or a view of it (identity,
  ``view``/``reshape``, ``transpose``);
* outputs that do not require grad (a mask passed through, integer outputs, statistics
  computed under ``detach``) come back from the replay not requiring grad, as in eager mode; at
  least one output of every layer must require grad (the backward of a chunk's first layer is
  what gives its slot back);
* inputs or parameters that no output depends on need ``allow_unused_input=True``; their
  gradients stay zero;
* dropout and other random ops of the default CUDA generator: every replay draws new numbers,
  the ones eager execution would draw at the same point of the generator's sequence (the
  capture's warm-up draws from the generator too: seed after capture to repeat an eager run);
  the same for generators passed in ``rng_generators``, such as those an RNG state tracker
  (TransformerEngine's, Megatron-LM's graph-safe one) swaps in around tensor-parallel dropout;
* buffers updated in place by the forward (``BatchNorm``'s running statistics in train mode):
  updated by every forward replay, as eager updates them. The warm-up's updates are undone, so
  capture leaves the buffers as it found them. A buffer the forward replaces (``self.buf =
  ...``) instead of updating in place, and a ``BatchNorm`` with ``momentum=None`` (which reads
  its batch count on the host), are refused;
* the training mode a layer and each of its submodules were captured in: calling it with any
  of them in the other mode and gradients enabled raises
  :class:`~graphpool.errors.FailedPrecondition` (under ``torch.no_grad()`` the layer runs
  eagerly, in whatever mode it is in);
* mixed precision: capture under ``torch.autocast("cuda", ...)`` captures the casts (autocast's
  weight cache is switched off for the warm-up and the capture, so every cast is made at each
  replay, from the current weights); the callables must then be called under the same autocast
  dtype, and a callable captured without autocast must be called without it (otherwise, with
  gradients enabled, :class:`~graphpool.errors.FailedPrecondition`);
* activation checkpointing with ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
  inside a layer: the recomputation is captured into the layer's backward graph. Reentrant
  checkpointing (``use_reentrant=True``) is refused: its backward cannot run under
  ``torch.autograd.grad``.

Not supported: host synchronization in a forward or backward (``.item()``, ``.cpu()``,
data-dependent shapes such as ``nonzero()``, Python control flow on tensor values; refused when
the capture fails with it), keyword or non-tensor inputs, outputs that are not tensors (``None``,
dicts), hooks registered on a layer's module or its submodules, gradient hooks on its
parameters (their gradients are accumulated inside the backward graphs, never through
autograd), data-parallel wrappers (``DistributedDataParallel``, whose all-reduce hooks would
not run either: graph ``ddp.module``'s layers and all-reduce ``param.grad`` after the step's
last backward; ``FullyShardedDataParallel``), sparse gradients, and a
layer whose outputs depend on a tensor that requires grad and is neither its input nor its own
parameter (a function using a module's parameters, a weight shared with a module the layer
does not hold: only a layer's own parameters get gradients). Hooks registered for every
module are logged as a warning: the replays run none of them.

Nothing here touches CUDA at import time, and torch is imported only when a function runs.
"""

from .build import make_graphed_callables
from .memory import POOL_KINDS
from .planning import (
    OVERHEAD_KEYS,
    LayerProfile,
    capture_plan_input,
    overhead_bytes,
    plan_description,
    request_plan,
)
from .refusals import UnsupportedLayer
from .replay import CaptureStats, GraphedSchedule

__all__ = [
    "OVERHEAD_KEYS",
    "POOL_KINDS",
    "CaptureStats",
    "GraphedSchedule",
    "LayerProfile",
    "UnsupportedLayer",
    "make_graphed_callables",
    "plan_description",
    "capture_plan_input",
    "overhead_bytes",
    "request_plan",
]
