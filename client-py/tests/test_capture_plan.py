"""The daemon's plan of a capture with a measured capture overhead (no torch needed: the layer
profiles are written by hand, as a profile recorded elsewhere would be), and the checks of
schedule-aware capture that need no GPU: inputs of the graphed callables, and the layers and
samples capture refuses before any CUDA call (stand-ins for tensors and modules; one test runs
``make_graphed_callables`` against a stand-in torch whose CUDA calls fail)."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
from gp_helpers import run_python

import graphpool
from graphpool.capture import (
    LayerProfile,
    OVERHEAD_KEYS,
    capture_plan_input,
    overhead_bytes,
    plan_description,
    request_plan,
)
from graphpool.schedule import Schedule

MiB = 1 << 20


def _profiles(layers: int) -> list[LayerProfile]:
    hidden = 2048 * 1024 * 2  # [2048, 1, 1024] bf16
    return [
        LayerProfile(
            chunk=0,
            layer=layer,
            input_bytes=hidden,
            output_bytes=hidden,
            saved_bytes=6 * hidden,
            forward_workspace_bytes=2 * hidden,
            backward_workspace_bytes=4 * hidden,
            input_shapes=[([2048, 1, 1024], "bfloat16", True)],
            output_shapes=[([2048, 1, 1024], "bfloat16")],
        )
        for layer in range(layers)
    ]


OVERHEAD = {
    "fixed_bytes": 136 * MiB,
    "per_graph_bytes": 172 * 1024,
    "per_pool_bytes": 4 * MiB,
    "backward_pool_extra_bytes": 126 * MiB,
}


def test_overhead_is_added_to_the_daemon_plan(daemon: object, client: graphpool.Client, job_id: str) -> None:
    schedule = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=16)
    with client.attach(job_id, rank=0) as s:
        bare = request_plan(schedule, _profiles(3), budget=None, client=s, reserve=False).plan
        full = request_plan(schedule, _profiles(3), budget=None, client=s, reserve=False, overhead=OVERHEAD).plan
    # 4 slots: 4 forward pools + 1 backward pool; 4 slots x 3 layers x 2 graphs
    assert (full.graphs, full.pools) == (24, 5)
    assert bare.overhead_bytes == 0 and bare.predicted_capture_bytes == bare.footprint_bytes
    assert full.overhead_bytes == overhead_bytes(OVERHEAD, graphs=24, pools=5)
    assert full.overhead_bytes == 136 * MiB + 24 * 172 * 1024 + 5 * 4 * MiB + 126 * MiB
    assert full.predicted_capture_bytes == full.footprint_bytes + full.overhead_bytes
    assert full.footprint_bytes == bare.footprint_bytes
    # the overhead does not grow with the number of microbatches (slots stay at 4)
    more = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=64)
    with client.attach(job_id, rank=0) as s:
        plan64 = request_plan(more, _profiles(3), budget=None, client=s, reserve=False, overhead=OVERHEAD).plan
    assert plan64.overhead_bytes == full.overhead_bytes


def test_bad_overhead_is_refused_with_the_key_named() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        overhead_bytes({"fixed": 1}, 1, 1)
    with pytest.raises(ValueError, match="per_pool_bytes"):
        overhead_bytes({"per_pool_bytes": -1}, 1, 1)
    assert set(OVERHEAD) == set(OVERHEAD_KEYS)
    # plan_description checks it as the daemon plan does, instead of writing it to the file
    schedule = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=16)
    with pytest.raises(ValueError, match="unknown keys"):
        plan_description(schedule, _profiles(2), {"fixed": 1})
    with pytest.raises(ValueError, match="fixed_bytes"):
        plan_description(schedule, _profiles(2), {"fixed_bytes": 1.5})  # type: ignore[dict-item]


def test_description_carries_the_overhead() -> None:
    schedule = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=16)
    assert "overhead" not in plan_description(schedule, _profiles(2))
    desc = plan_description(schedule, _profiles(2), OVERHEAD)
    assert desc["overhead"] == OVERHEAD
    assert [layer["layer"] for layer in desc["layers"]] == [0, 1]


def test_a_long_plan_outlives_the_client_timeout(daemon: object, job_id: str) -> None:
    """A schedule whose plan stays above its lower bound is searched for the whole time
    budget; the call waits for it beyond the client's own timeout instead of failing."""
    from graphpool._proto.graphpool.v1 import plan_pb2

    def tensor(name: str, shape: list[int], dtype: str, kept: bool = False) -> Any:
        return plan_pb2.TensorSpec(name=name, shape=shape, dtype=dtype, kept_for_backward=kept)

    # A 1F1B stage whose layers take several inputs of their own shapes, and whose 64 MiB
    # activation of the first layer must lie beside the bytes its slot has freed: the plan
    # stays 2% above its bound however long the search runs (10 s of a release build on 2
    # cores), so the search takes the whole budget.
    layers = [
        plan_pb2.LayerSpec(
            chunk=0,
            layer=0,
            inputs=[tensor("hidden", [64, 2048], "f16", True), tensor("mask", [64, 4, 5120], "f16")],
            outputs=[tensor("hidden", [4096, 8192], "bf16")],
            saved_bytes=44302336,
            forward_workspace_bytes=3801088,
            backward_workspace_bytes=7481160,
        ),
        plan_pb2.LayerSpec(
            chunk=0,
            layer=1,
            inputs=[tensor("hidden", [512, 4, 8192], "bf16", True), tensor("mask", [4, 512, 2048], "f32")],
            outputs=[tensor("hidden", [4, 128, 1024], "bf16")],
            forward_workspace_bytes=12002381,
            backward_workspace_bytes=17811861,
        ),
        plan_pb2.LayerSpec(
            chunk=0,
            layer=2,
            inputs=[tensor("hidden", [128, 4, 2048], "f8e4m3", True)],
            outputs=[tensor("hidden", [128, 8192], "f8e4m3")],
            saved_bytes=23986176,
            forward_workspace_bytes=8912896,
            backward_workspace_bytes=14548992,
        ),
    ]
    schedule = Schedule.one_f_one_b(pp_size=16, pp_rank=12, num_microbatches=8)
    plan_input = plan_pb2.PlanInput(
        schedule=plan_pb2.SchedulePlanInput(schedule=schedule.to_proto(), layers=layers), time_budget_ms=1500
    )
    client = graphpool.Client(daemon.socket, timeout=0.5)  # type: ignore[attr-defined]
    try:
        with client.attach(job_id, rank=0) as s:
            plan = s.plan_capture(plan_input, reserve=False).plan
    finally:
        client.close()
    assert plan.footprint_bytes > plan.lower_bound_bytes
    assert plan.planning_seconds >= 1.0


def test_capture_asks_for_the_plan_without_its_buffers(
    daemon: object, client: graphpool.Client, job_id: str
) -> None:
    """Capture checks the footprint and the prediction: its plan comes without the per-buffer
    list, which a schedule of thousands of microbatches could not send in one message."""
    schedule = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=16)
    with client.attach(job_id, rank=0) as s:
        summary = request_plan(schedule, _profiles(3), budget=None, client=s, reserve=False).plan
        full = s.plan_capture(capture_plan_input(schedule, _profiles(3)), reserve=False).plan
    assert len(summary.buffers) == 0 and len(full.buffers) > 0
    assert summary.lower_bound_bytes == full.lower_bound_bytes
    assert list(summary.microbatch_slot) == list(full.microbatch_slot)
    assert summary.footprint_bytes >= summary.lower_bound_bytes > 0


def test_plan_through_a_client_names_the_session(daemon: object, client: graphpool.Client, job_id: str) -> None:
    """``make_graphed_callables(client=graphpool.Client(...))`` is documented; the plan goes
    through the Client for a session of this process (the capture's pools' session), and is
    reserved for that session. Without a session id it says what is missing."""
    schedule = Schedule.one_f_one_b(pp_size=4, pp_rank=0, num_microbatches=16)
    with client.attach(job_id, rank=0) as s:
        resp = request_plan(schedule, _profiles(3), budget=None, client=client, session_id=s.session_id)
        assert resp.reserved_bytes >= resp.plan.footprint_bytes > 0
        job = client.usage().job(job_id)
        assert job is not None and job.sessions == 1
        # A Session as client plans for a session named by id through its Client, too.
        again = request_plan(
            schedule, _profiles(3), budget=None, client=s, session_id=s.session_id, reserve=False
        )
        assert again.plan.footprint_bytes == resp.plan.footprint_bytes and again.reserved_bytes == 0
    with pytest.raises(TypeError, match="session_id"):
        request_plan(schedule, _profiles(3), budget=None, client=client)


def test_graphed_schedule_indices_do_not_wrap_around() -> None:
    """``gs[layer, microbatch]``, ``layer()`` and ``chunk()`` refuse negative and too-large
    indices, naming the argument, instead of picking another layer or microbatch."""
    from graphpool.capture import CaptureStats, GraphedSchedule
    from graphpool.capture.layers import _Layer
    from graphpool.schedule import Schedule

    schedule = Schedule.one_f_one_b(pp_size=2, pp_rank=0, num_microbatches=4)
    nslots = schedule.slots_per_chunk[0]
    lay = _Layer(0, 0, object(), nslots, True, True)
    gs = GraphedSchedule(schedule, [[lay]], [], CaptureStats())
    assert callable(gs[0, 3]) and len(gs.layer(0)) == 4 and len(gs.chunk(0, 3)) == 1
    for bad in [lambda: gs[0, -1], lambda: gs[-1, 0], lambda: gs[0, 4], lambda: gs[1, 0]]:
        with pytest.raises(IndexError, match="layer|microbatch"):
            bad()
    with pytest.raises(IndexError, match="layer"):
        gs.layer(-1)
    with pytest.raises(IndexError, match="chunk"):
        gs.chunk(-1, 0)
    with pytest.raises(IndexError, match="microbatch"):
        gs.chunk(0, -1)


class _Pool:
    def __init__(self, released: list[str], name: str, error: Exception | None = None) -> None:
        self.released, self.name, self.error = released, name, error

    def release(self) -> None:
        self.released.append(self.name)
        if self.error is not None:
            raise self.error


def test_graphed_schedule_close_releases_every_pool_when_one_fails() -> None:
    """A pool whose release fails (the daemon gone, say) does not keep the others: every pool
    is released, then the first error is raised."""
    from graphpool.capture import CaptureStats, GraphedSchedule
    from graphpool.capture.layers import _Layer

    schedule = Schedule.one_f_one_b(pp_size=2, pp_rank=0, num_microbatches=4)
    released: list[str] = []
    pools = [
        ("fwd/c0/s0", _Pool(released, "s0", graphpool.DaemonUnavailable("/g.sock", "gone"))),
        ("fwd/c0/s1", _Pool(released, "s1", RuntimeError("second"))),
        ("bwd", _Pool(released, "bwd")),
    ]
    lay = _Layer(0, 0, object(), schedule.slots_per_chunk[0], True, True)
    gs = GraphedSchedule(schedule, [[lay]], pools, CaptureStats())
    with pytest.raises(graphpool.DaemonUnavailable, match="gone"):
        gs.close()
    assert released == ["s0", "s1", "bwd"]
    gs.close()  # idempotent: nothing is released twice
    assert released == ["s0", "s1", "bwd"]


def test_graphed_call_inputs_are_checked_against_the_capture() -> None:
    """The message names the input, the captured and the given shape and dtype (the GPU test
    tests/gpu/test_capture_calls.py checks the same on real graphs)."""
    from types import SimpleNamespace

    from graphpool.capture.layers import _Layer
    from graphpool.capture.refusals import _check_inputs

    def t(shape: tuple[int, ...], dtype: str = "torch.float32") -> Any:
        return SimpleNamespace(shape=shape, dtype=dtype)

    lay = _Layer(0, 0, object(), 1, True, True)
    lay.static_in[0] = (t((2, 8)), t((2,), "torch.int64"))
    _check_inputs(lay, 0, (t((2, 8)), t((2,), "torch.int64")))
    with pytest.raises(TypeError, match="2 input.*got 1"):
        _check_inputs(lay, 0, (t((2, 8)),))
    with pytest.raises(TypeError, match="input 1 .* must be a tensor, not int"):
        _check_inputs(lay, 0, (t((2, 8)), 3))
    with pytest.raises(ValueError, match=r"input 0 .*expected shape \(2, 8\).*got shape \(4, 8\)"):
        _check_inputs(lay, 0, (t((4, 8)), t((2,), "torch.int64")))
    with pytest.raises(ValueError, match="input 1 .*dtype torch.int64.*dtype torch.int32"):
        _check_inputs(lay, 0, (t((2, 8)), t((2,), "torch.int32")))
    # a later layer of the chunk: checked against the previous layer's outputs
    later = _Layer(0, 1, object(), 1, False, True)
    later.static_in[0] = (t((2, 8)), t((2,), "torch.int64"))
    with pytest.raises(TypeError, match=r"layer 1 of chunk 0 .*2 input.*outputs of layer 0.*got 1"):
        _check_inputs(later, 0, (t((2, 8)),))
    with pytest.raises(ValueError, match=r"input 0 of layer 1 of chunk 0: expected shape \(2, 8\)"):
        _check_inputs(later, 0, (t((2, 9)), t((2,), "torch.int64")))


# --------------------------------------------------------------------------- refusals, no GPU


class _T:
    """A stand-in tensor: what capture's checks look at."""

    def __init__(
        self, shape: tuple[int, ...] = (2, 8), device: str = "cuda", requires_grad: bool = True
    ) -> None:
        self.shape, self.dtype, self.requires_grad = shape, "torch.float32", requires_grad
        self.device = SimpleNamespace(type=device)

    def __repr__(self) -> str:
        return f"_T({self.shape})"

    def detach(self) -> "_T":
        return self


class _Module:
    """A stand-in ``torch.nn.Module``: submodules, buffers and hooks as capture reads them."""

    def __init__(self, **attrs: Any) -> None:
        self.training = True
        self._forward_hooks: dict[int, Any] = {}
        self._subs: list[tuple[str, Any]] = []
        self._bufs: list[tuple[str, Any]] = []
        self._params: list[tuple[str, Any]] = []
        self.__dict__.update(attrs)

    def __call__(self, *args: Any) -> Any:
        return args

    def named_modules(self) -> list[tuple[str, Any]]:
        return [("", self)] + self._subs

    def named_buffers(self) -> list[tuple[str, Any]]:
        return list(self._bufs)

    def named_parameters(self, recurse: bool = True) -> list[tuple[str, Any]]:
        assert not recurse, "capture reads each submodule's own parameters"
        return list(self._params)


def _batchnorm(momentum: float | None, training: bool = True) -> _Module:
    return _Module(training=training, track_running_stats=True, running_mean=_T((8,)), momentum=momentum)


def test_unsupported_layer_is_an_invalid_argument_naming_the_layer() -> None:
    from graphpool.capture import UnsupportedLayer

    e = UnsupportedLayer(1, 3, _Module(), "returns a dict: return tensors")
    assert isinstance(e, graphpool.InvalidArgument) and isinstance(e, ValueError)
    assert (e.chunk, e.layer, e.field, e.description) == (1, 3, "callables", "returns a dict: return tensors")
    assert str(e) == "layer 3 of chunk 1 (_Module): returns a dict: return tensors"


def test_samples_that_are_not_gpu_tensors_are_refused() -> None:
    """A chunk input that is not a tensor, or a tensor off the GPU, is refused naming the chunk
    and the input, before anything runs."""
    from graphpool.capture.refusals import _check_samples

    _check_samples([(_T(),), (_T(), _T((2,), requires_grad=False))])
    for samples, words in [
        ([(_T(), 3)], "sample_args of chunk 0: input 1 is a int, not a tensor"),
        ([(_T(),), (None,)], "sample_args of chunk 1: input 0 is a NoneType"),
        ([(_T(device="cpu"),)], "input 0 is on .*cpu.*not on a CUDA device"),
    ]:
        with pytest.raises(graphpool.InvalidArgument, match=words) as info:
            _check_samples(samples)
        assert info.value.field == "sample_args"


def test_layers_that_cannot_replay_as_eager_are_refused_before_capture() -> None:
    """Hooks (on modules, and gradient hooks on parameters), a BatchNorm in train mode with
    momentum=None (itself or a submodule), data-parallel wrappers and a layer that is not
    callable are refused naming the chunk and layer; a BatchNorm with a float momentum, or in
    eval mode, and a parameter whose hooks were removed are fine."""
    from graphpool.capture import UnsupportedLayer
    from graphpool.capture.refusals import _check_modules

    unhooked = _T()
    unhooked._backward_hooks = {}  # a hook registered, then removed
    fine = [_Module(), _batchnorm(0.1), _batchnorm(None, training=False), lambda x: x,
            _Module(_params=[("weight", unhooked), ("bias", _T())])]
    _check_modules([fine, [_Module(_subs=[("norm", _batchnorm(0.1))])]])
    hooked = _Module(_forward_hooks={0: print})
    grad_hooked, accumulate_hooked = _T(), _T()
    grad_hooked._backward_hooks = {0: print}
    accumulate_hooked._post_accumulate_grad_hooks = {0: print}
    DistributedDataParallel = type("DistributedDataParallel", (_Module,), {})
    FullyShardedDataParallel = type("FullyShardedDataParallel", (_Module,), {})
    cases = [
        ([[_Module(), hooked]], 0, 1, "registered hooks \\(forward_hooks\\)"),
        ([[_Module()], [_batchnorm(None)]], 1, 0, "it has momentum=None.*float momentum"),
        ([[_Module(), _Module(_subs=[("block.norm", _batchnorm(None))])]], 0, 1,
         "its submodule 'block.norm' \\(_Module\\) has momentum=None"),
        ([[_Module(), object()]], 0, 1, "not callable"),
        ([[_Module(_subs=[("mlp.act", _Module(_forward_hooks={0: print}))])]], 0, 0,
         "its submodule 'mlp.act' \\(_Module\\) has registered hooks \\(forward_hooks\\)"),
        ([[_Module(_params=[("weight", grad_hooked)])]], 0, 0,
         "its parameter 'weight' has gradient hooks \\(register_hook\\), which would never "
         "run.*all-reduce"),
        ([[_Module(), _Module(_subs=[("fc", _Module(_params=[("bias", accumulate_hooked)]))])]], 0, 1,
         "its parameter 'fc.bias' has gradient hooks \\(register_post_accumulate_grad_hook\\)"),
        ([[DistributedDataParallel()]], 0, 0,
         "it is a DistributedDataParallel: its gradient all-reduce .*\\.module"),
        ([[_Module(_subs=[("block", FullyShardedDataParallel())])]], 0, 0,
         "its submodule 'block' \\(FullyShardedDataParallel\\) is a FullyShardedDataParallel: "
         "it gathers and frees its parameters"),
    ]
    for chunks, chunk, layer, words in cases:
        with pytest.raises(UnsupportedLayer, match=f"layer {layer} of chunk {chunk} .*{words}") as info:
            _check_modules(chunks)
        assert (info.value.chunk, info.value.layer) == (chunk, layer)


def test_a_flat_tuple_of_tensors_is_the_first_layers_inputs() -> None:
    """For one chunk, ``(x, mask)`` is the first layer's two inputs even when the chunk has two
    layers (not a sample per layer); tuples per layer and per chunk keep their meaning."""
    from graphpool.capture.layers import _chunk_samples

    x, mask, y = _T(), _T((2,), requires_grad=False), _T()
    assert _chunk_samples((x, mask), [["l0", "l1"]]) == [(x, mask)]
    assert _chunk_samples([(x, mask), (y,)], [["l0", "l1"]]) == [(x, mask)]
    assert _chunk_samples([(x,), (y,)], [["l0"], ["l1"]]) == [(x,), (y,)]
    assert _chunk_samples([(x,), (mask,), (y,), (y,)], [["a", "b"], ["c", "d"]]) == [(x,), (y,)]
    with pytest.raises(ValueError, match="one tuple per layer \\(4\\) or per chunk \\(2\\)"):
        _chunk_samples([(x,), (y,), (y,)], [["a", "b"], ["c", "d"]])


def test_a_layer_whose_submodule_changed_mode_is_refused() -> None:
    """A call with gradients enabled checks the training mode of the layer's module and of
    every submodule against the capture's, and names a submodule that changed alone."""
    from graphpool.capture.layers import _Layer
    from graphpool.capture.modes import _mode_changed

    inner = _Module()
    outer = _Module(_subs=[("drop", inner)])
    outer.modules = lambda: [outer, inner]
    lay = _Layer(0, 0, outer, 1, True, True)
    assert _mode_changed(lay) is None
    inner.training = False
    assert _mode_changed(lay) is inner
    inner.training = True
    outer.training = False
    assert _mode_changed(lay) is outer


class _Node:
    """A stand-in autograd node: ``next_functions`` as torch gives them, ``variable`` on a
    gradient accumulator."""

    def __init__(self, *nexts: "_Node | None", variable: Any = None) -> None:
        self.next_functions = tuple((n, 0) for n in nexts)
        if variable is not None:
            self.variable = variable


def test_a_tensor_the_layer_does_not_own_is_found_at_the_graphs_leaves() -> None:
    """The walk from the outputs reaches every gradient accumulator, through shared nodes and
    ``None`` edges, and reports a leaf that is neither an input nor a parameter."""
    from graphpool.capture.refusals import _foreign_leaf

    x, w, shared_w = _T(), _T((8, 8)), _T((8, 8))
    acc_x, acc_w, acc_shared = _Node(variable=x), _Node(variable=w), _Node(variable=shared_w)
    mm = _Node(acc_x, acc_w)
    # a residual: the sum reads the matmul twice (a diamond) and x again; one edge is None
    out = SimpleNamespace(grad_fn=_Node(mm, _Node(mm, None), acc_x))
    assert _foreign_leaf([out], [x, w]) is None
    tied = SimpleNamespace(grad_fn=_Node(_Node(mm, acc_shared)))
    assert _foreign_leaf([out, tied], [x, w]) is shared_w
    assert _foreign_leaf([out, tied], [x, w, shared_w]) is None
    assert _foreign_leaf([SimpleNamespace(grad_fn=None)], []) is None


def test_layer_outputs_must_be_tensors_one_of_which_requires_grad() -> None:
    from graphpool.capture import UnsupportedLayer
    from graphpool.capture.layers import _Layer
    from graphpool.capture.refusals import _layer_outputs

    lay = _Layer(0, 2, _Module(), 1, False, False)
    y, mask = _T(), _T(requires_grad=False)
    assert _layer_outputs(lay, y) == (y,)
    assert _layer_outputs(lay, [y, mask]) == (y, mask)
    for raw, words in [
        ((y, None), "output 1 is a NoneType, not a tensor"),
        ({"h": y}, "output 0 is a dict, not a tensor"),
        ((), "returns an empty sequence"),
        ((mask,), "returns no tensor that requires grad"),
    ]:
        with pytest.raises(UnsupportedLayer, match=f"layer 2 of chunk 0 \\(_Module\\): {words}"):
            _layer_outputs(lay, raw)


def test_a_buffer_the_forward_replaces_is_refused() -> None:
    from graphpool.capture import UnsupportedLayer
    from graphpool.capture.layers import _Layer, _layer_buffers
    from graphpool.capture.refusals import _check_buffers_kept

    count, stats = _T((1,)), _T((8,))
    mod = _Module(_bufs=[("count", count), ("norm.running_mean", stats)])
    lay = _Layer(0, 1, mod, 1, False, False)
    before = _layer_buffers(lay)
    _check_buffers_kept(lay, before)  # updated in place: the same tensors
    mod._bufs = [("count", _T((1,))), ("norm.running_mean", stats)]
    with pytest.raises(UnsupportedLayer, match="layer 1 of chunk 0 .*buffer 'count' instead of updating"):
        _check_buffers_kept(lay, before)
    assert _layer_buffers(_Layer(0, 0, lambda x: x, 1, True, True)) == []


def test_capture_failures_of_host_work_are_refused_naming_the_layer() -> None:
    """A capture that fails because the layer synchronizes with the host becomes an
    UnsupportedLayer saying what to change; any other failure (out of memory, an invalidated
    capture, the layer's own error) is raised as it is."""
    from graphpool.capture.layers import _Layer
    from graphpool.capture.refusals import _capture_refusal

    lay = _Layer(1, 4, _Module(), 1, False, False)
    e = _capture_refusal(lay, "forward", RuntimeError(
        "CUDA error: operation not permitted when stream is capturing\nCompile with TORCH_USE_CUDA_DSA"))
    assert e is not None and (e.chunk, e.layer) == (1, 4)
    assert "its forward cannot be captured" in str(e) and ".item()" in str(e) and "DSA" not in str(e)
    e = _capture_refusal(lay, "backward", RuntimeError(
        "operation not permitted when stream is capturing"))
    assert e is not None and "its backward cannot be captured" in str(e)
    for other in [
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB during capture"),
        RuntimeError("CUDA error: operation failed due to a previous error during capture"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x3 and 4x4)"),
        ValueError("not permitted when stream is capturing"),
    ]:
        assert _capture_refusal(lay, "forward", other) is None, other


def test_capture_failures_of_random_number_generators_say_which_generator_to_pass() -> None:
    """A layer that draws from a generator no graph was registered with (an RNG state
    tracker's, swapped in around dropout) is refused pointing at ``rng_generators``; one that
    reads or sets the generator's state on the host (a tracker that copies state tensors)
    pointing at graph-safe trackers. Neither is called host synchronization."""
    from graphpool.capture.layers import _Layer
    from graphpool.capture.refusals import _capture_refusal

    lay = _Layer(0, 3, _Module(), 1, False, False)
    e = _capture_refusal(lay, "forward", RuntimeError(
        "Attempt to increase offset for a CUDA generator not in capture mode."))
    assert e is not None and (e.chunk, e.layer) == (0, 3)
    assert "rng_generators=" in str(e) and "get_all_rng_states" in str(e) and ".item()" not in str(e)
    e = _capture_refusal(lay, "backward", RuntimeError(
        "Cannot call CUDAGeneratorImpl::current_seed during CUDA graph capture. If you need this "
        "call to be captured, please file an issue."))
    assert e is not None and "its backward reads or sets the CUDA generator" in str(e)
    assert "graph-safe tracker" in str(e) and "file an issue" not in str(e)


def test_a_failed_capture_body_is_abandoned_and_host_work_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward and backward captures share one body guard: it begins the capture into the
    pool, leaves a capture that succeeded open for the caller to end, and abandons one that
    failed, raising host work as UnsupportedLayer (the original as its cause) and any other
    error as it is."""
    from graphpool import capture
    from graphpool.capture import record
    from graphpool.capture.layers import _Layer

    abandoned: list[Any] = []
    monkeypatch.setattr(record, "_abandon_capture", lambda g, pool, gens: abandoned.append((g, pool)))
    g = SimpleNamespace(begun=[], capture_begin=lambda pool: g.begun.append(pool))
    monkeypatch.setattr(record, "_new_graph", lambda gens: g)
    lay = _Layer(0, 2, _Module(), 1, False, False)
    with record._capturing("pool", lay, "forward", ()) as made:
        assert made is g
    assert g.begun == ["pool"] and abandoned == []
    host = RuntimeError("operation not permitted when stream is capturing")
    with pytest.raises(capture.UnsupportedLayer, match="layer 2 of chunk 0 .*its backward cannot be captured") as info:
        with record._capturing("pool", lay, "backward", ()):
            raise host
    assert info.value.__cause__ is host and abandoned == [(g, "pool")]
    with pytest.raises(ValueError, match="shapes"):
        with record._capturing("pool", lay, "forward", ()):
            raise ValueError("shapes cannot be multiplied")
    assert len(abandoned) == 2


def test_reentrant_checkpointing_is_recognised_by_its_refusal_of_autograd_grad() -> None:
    """torch's ``use_reentrant=True`` checkpoint and checkpoint functions built like it refuse
    ``torch.autograd.grad``; the warm-up turns that into an :class:`UnsupportedLayer` that says
    to pass ``use_reentrant=False``."""
    from graphpool.capture.refusals import _reentrant_checkpoint

    assert _reentrant_checkpoint(RuntimeError(
        "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or passing "
        "an `inputs` parameter to .backward(). To resolve this error, you can either set "
        "use_reentrant=False, or call .backward() without passing the `inputs` argument."))
    assert _reentrant_checkpoint(RuntimeError(
        "Checkpointing is not compatible with .grad(), please use .backward() if possible"))
    assert not _reentrant_checkpoint(RuntimeError("One of the differentiated Tensors appears to "
                                                  "not have been used in the graph"))
    assert not _reentrant_checkpoint(RuntimeError("checkpoint file not found"))


def test_capture_under_autocast_turns_its_weight_cache_off_and_back() -> None:
    """Under a caller's autocast the warm-up and the capture run with autocast's weight cache
    cleared and off (a cached cast would be captured as a constant); the caller's setting is
    back afterwards, after a failure too. Without autocast nothing is touched."""
    code = textwrap.dedent(
        """
        import sys, types
        calls = []
        torch = types.ModuleType("torch")
        state = {"cache": True}
        torch.clear_autocast_cache = lambda: calls.append("clear")
        torch.is_autocast_cache_enabled = lambda: state["cache"]
        def set_cache(on):
            calls.append(f"set {on}")
            state["cache"] = on
        torch.set_autocast_cache_enabled = set_cache
        sys.modules["torch"] = torch

        from graphpool.capture.modes import _uncached_autocast

        with _uncached_autocast(None):
            print("none", calls, state["cache"])
        with _uncached_autocast("bf16"):
            print("inside", calls, state["cache"])
        print("after", state["cache"])
        try:
            with _uncached_autocast("bf16"):
                raise RuntimeError("capture failed")
        except RuntimeError:
            print("after a failure", state["cache"])
        state["cache"] = False
        with _uncached_autocast("bf16"):
            pass
        print("off before, off after", state["cache"])
        """
    )
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "none [] True",
        "inside ['clear', 'set False'] False",
        "after True",
        "after a failure True",
        "off before, off after False",
    ]


STANDIN_TORCH = """
import sys, types

cuda_calls = []

class _Cuda(types.ModuleType):
    def __getattr__(self, name):
        def call(*args, **kwargs):
            cuda_calls.append(name)
            raise RuntimeError(f"torch.cuda.{name} called")
        return call

torch = types.ModuleType("torch")
torch.is_autocast_enabled = lambda device_type="cuda": False
torch.is_grad_enabled = lambda: True
torch.cuda = _Cuda("torch.cuda")
sys.modules["torch"] = torch
sys.modules["torch.cuda"] = torch.cuda

from graphpool import capture, errors
from graphpool.capture.layers import _Layer
from graphpool.schedule import Schedule

class T:
    def __init__(self, device="cuda"):
        self.shape, self.dtype, self.requires_grad = (2, 8), "float32", True
        self.device = types.SimpleNamespace(type=device)
    def detach(self):
        return self

class Layer:
    training = True
    def __call__(self, *args):
        return args
"""


def test_a_later_layer_takes_only_the_previous_layers_outputs() -> None:
    """The layers of a chunk are captured as a chain (a later layer's static input is the
    previous layer's static output, the same memory): a later layer called with anything but
    those outputs as returned (``norm(h)``, a copy, a view in another layout) is refused before
    anything replays, instead of being copied over the previous layer's output. Stand-in
    torch (the GPU test tests/gpu/test_capture_calls.py checks the same on real graphs)."""
    code = STANDIN_TORCH + textwrap.dedent(
        """
        class P(T):
            def __init__(self, ptr, stride=(8, 1)):
                super().__init__()
                self.ptr, self.strides = ptr, stride
            def data_ptr(self):
                return self.ptr
            def stride(self):
                return self.strides

        sched = Schedule.one_f_one_b(2, 0, 4)
        first = _Layer(0, 0, Layer(), 2, True, False)
        second = _Layer(0, 1, Layer(), 2, False, True)
        gs = capture.GraphedSchedule(sched, [[first, second]], [], capture.CaptureStats())
        h = P(1000)  # layer 0's output in slot 0 (what its callable returned)
        second.static_in[0] = (h,)
        gs._owner[0][0] = 0  # microbatch 0's forward of layer 0 ran
        for given in (P(2000), P(1000, stride=(1, 2))):  # norm(h) or a copy; a transposed view
            try:
                gs[1, 0](given)
            except errors.InvalidArgument as e:
                print(type(e).__name__, e.field, "layer 1 of chunk 0" in str(e),
                      "exactly as returned" in str(e))
        try:
            gs[1, 0](P(1000))
        except AttributeError as e:  # past the checks: the stand-in torch cannot replay
            print("replays:", "autograd" in str(e))
        print("slots", gs.slots_in_use())
        """
    )
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "InvalidArgument args True True",
        "InvalidArgument args True True",
        "replays: True",
        "slots [[0, None]]",
    ]


def test_make_graphed_callables_refuses_before_any_cuda_call() -> None:
    """Bad samples and layers are refused before capture touches CUDA (a stand-in torch whose
    every torch.cuda call fails); a callable called in another training mode, or another
    autocast state, than it was captured in is refused before it replays."""
    code = STANDIN_TORCH + textwrap.dedent(
        """
        sched = Schedule.one_f_one_b(2, 0, 4)

        def refused(layers, sample):
            try:
                capture.make_graphed_callables(layers, [sample], schedule=sched, pools="torch")
            except errors.InvalidArgument as e:
                return f"{type(e).__name__} {e.field}"
            return "captured"

        print(refused([Layer(), Layer()], (T(device="cpu"),)))
        bn = Layer()
        bn.track_running_stats, bn.running_mean, bn.momentum = True, T(), None
        bn.named_modules = lambda: [("", bn)]
        print(refused([Layer(), bn], (T(),)))
        print("cuda calls:", cuda_calls)

        lay = _Layer(0, 0, Layer(), 2, True, True)
        gs = capture.GraphedSchedule(sched, [[lay]], [], capture.CaptureStats())
        lay.module.training = False
        try:
            gs[0, 0](T())
        except errors.FailedPrecondition as e:
            print("FailedPrecondition", "training mode" in str(e) and "no_grad" in str(e))
        print("slots", gs.slots_in_use())
        lay.module.training = True

        # captured without autocast, called under it (and the reverse)
        torch.is_autocast_enabled = lambda device_type: True
        torch.get_autocast_dtype = lambda device_type: "torch.bfloat16"
        try:
            gs[0, 0](T())
        except errors.FailedPrecondition as e:
            print("FailedPrecondition", "captured without autocast" in str(e),
                  "called under torch.autocast(dtype=bfloat16)" in str(e))
        torch.float16 = "torch.float16"
        gs16 = capture.GraphedSchedule(sched, [[lay]], [], capture.CaptureStats(autocast="float16"))
        try:
            gs16[0, 0](T())
        except errors.FailedPrecondition as e:
            print("FailedPrecondition", "captured under torch.autocast(dtype=float16)" in str(e))
        torch.is_autocast_enabled = lambda device_type: False
        try:
            gs16[0, 0](T())
        except errors.FailedPrecondition as e:
            print("FailedPrecondition", "called without autocast" in str(e))
        print("slots", gs.slots_in_use(), gs16.slots_in_use())
        """
    )
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "InvalidArgument sample_args",
        "UnsupportedLayer callables",
        "cuda calls: []",
        "FailedPrecondition True",
        "slots [[None, None]]",
        "FailedPrecondition True True",
        "FailedPrecondition True",
        "FailedPrecondition True",
        "slots [[None, None]] [[None, None]]",
    ]
