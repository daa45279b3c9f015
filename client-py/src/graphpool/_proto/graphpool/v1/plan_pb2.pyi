from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlanInput(_message.Message):
    __slots__ = ("schedule", "buffers", "time_budget_ms")
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    TIME_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    schedule: SchedulePlanInput
    buffers: BufferList
    time_budget_ms: int
    def __init__(self, schedule: _Optional[_Union[SchedulePlanInput, _Mapping]] = ..., buffers: _Optional[_Union[BufferList, _Mapping]] = ..., time_budget_ms: _Optional[int] = ...) -> None: ...

class SchedulePlanInput(_message.Message):
    __slots__ = ("schedule", "layers", "overhead")
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_FIELD_NUMBER: _ClassVar[int]
    schedule: Schedule
    layers: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    overhead: CaptureOverhead
    def __init__(self, schedule: _Optional[_Union[Schedule, _Mapping]] = ..., layers: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ..., overhead: _Optional[_Union[CaptureOverhead, _Mapping]] = ...) -> None: ...

class CaptureOverhead(_message.Message):
    __slots__ = ("fixed_bytes", "per_graph_bytes", "per_pool_bytes", "backward_pool_extra_bytes")
    FIXED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PER_GRAPH_BYTES_FIELD_NUMBER: _ClassVar[int]
    PER_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_POOL_EXTRA_BYTES_FIELD_NUMBER: _ClassVar[int]
    fixed_bytes: int
    per_graph_bytes: int
    per_pool_bytes: int
    backward_pool_extra_bytes: int
    def __init__(self, fixed_bytes: _Optional[int] = ..., per_graph_bytes: _Optional[int] = ..., per_pool_bytes: _Optional[int] = ..., backward_pool_extra_bytes: _Optional[int] = ...) -> None: ...

class Schedule(_message.Message):
    __slots__ = ("one_f_one_b", "interleaved", "explicit_order")
    ONE_F_ONE_B_FIELD_NUMBER: _ClassVar[int]
    INTERLEAVED_FIELD_NUMBER: _ClassVar[int]
    EXPLICIT_ORDER_FIELD_NUMBER: _ClassVar[int]
    one_f_one_b: OneFOneB
    interleaved: Interleaved
    explicit_order: ExplicitOrder
    def __init__(self, one_f_one_b: _Optional[_Union[OneFOneB, _Mapping]] = ..., interleaved: _Optional[_Union[Interleaved, _Mapping]] = ..., explicit_order: _Optional[_Union[ExplicitOrder, _Mapping]] = ...) -> None: ...

class OneFOneB(_message.Message):
    __slots__ = ("pp_size", "pp_rank", "num_microbatches")
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    pp_size: int
    pp_rank: int
    num_microbatches: int
    def __init__(self, pp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., num_microbatches: _Optional[int] = ...) -> None: ...

class Interleaved(_message.Message):
    __slots__ = ("pp_size", "pp_rank", "num_microbatches", "virtual_chunks")
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    pp_size: int
    pp_rank: int
    num_microbatches: int
    virtual_chunks: int
    def __init__(self, pp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., num_microbatches: _Optional[int] = ..., virtual_chunks: _Optional[int] = ...) -> None: ...

class ExplicitOrder(_message.Message):
    __slots__ = ("order", "num_microbatches", "virtual_chunks")
    ORDER_FIELD_NUMBER: _ClassVar[int]
    NUM_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    order: _containers.RepeatedScalarFieldContainer[int]
    num_microbatches: int
    virtual_chunks: int
    def __init__(self, order: _Optional[_Iterable[int]] = ..., num_microbatches: _Optional[int] = ..., virtual_chunks: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "kept_for_backward")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KEPT_FOR_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    kept_for_backward: bool
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., kept_for_backward: bool = ...) -> None: ...

class LayerSpec(_message.Message):
    __slots__ = ("chunk", "layer", "inputs", "outputs", "saved_bytes", "forward_workspace_bytes", "backward_workspace_bytes")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    layer: int
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    saved_bytes: int
    forward_workspace_bytes: int
    backward_workspace_bytes: int
    def __init__(self, chunk: _Optional[int] = ..., layer: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., saved_bytes: _Optional[int] = ..., forward_workspace_bytes: _Optional[int] = ..., backward_workspace_bytes: _Optional[int] = ...) -> None: ...

class BufferList(_message.Message):
    __slots__ = ("buffers",)
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    buffers: _containers.RepeatedCompositeFieldContainer[BufferSpec]
    def __init__(self, buffers: _Optional[_Iterable[_Union[BufferSpec, _Mapping]]] = ...) -> None: ...

class BufferSpec(_message.Message):
    __slots__ = ("name", "start", "end", "size_bytes", "alias_group")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALIAS_GROUP_FIELD_NUMBER: _ClassVar[int]
    name: str
    start: int
    end: int
    size_bytes: int
    alias_group: str
    def __init__(self, name: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., size_bytes: _Optional[int] = ..., alias_group: _Optional[str] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("slots", "microbatch_slot", "buffers", "footprint_bytes", "lower_bound_bytes", "saved_by_aliasing_bytes", "planning_seconds", "strategy", "steps", "predicted_capture_bytes", "graphs", "pools", "overhead_bytes", "live_bound_bytes")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_SLOT_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    FOOTPRINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOWER_BOUND_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAVED_BY_ALIASING_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLANNING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CAPTURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIVE_BOUND_BYTES_FIELD_NUMBER: _ClassVar[int]
    slots: int
    microbatch_slot: _containers.RepeatedScalarFieldContainer[int]
    buffers: _containers.RepeatedCompositeFieldContainer[PlannedBuffer]
    footprint_bytes: int
    lower_bound_bytes: int
    saved_by_aliasing_bytes: int
    planning_seconds: float
    strategy: str
    steps: _containers.RepeatedScalarFieldContainer[int]
    predicted_capture_bytes: int
    graphs: int
    pools: int
    overhead_bytes: int
    live_bound_bytes: int
    def __init__(self, slots: _Optional[int] = ..., microbatch_slot: _Optional[_Iterable[int]] = ..., buffers: _Optional[_Iterable[_Union[PlannedBuffer, _Mapping]]] = ..., footprint_bytes: _Optional[int] = ..., lower_bound_bytes: _Optional[int] = ..., saved_by_aliasing_bytes: _Optional[int] = ..., planning_seconds: _Optional[float] = ..., strategy: _Optional[str] = ..., steps: _Optional[_Iterable[int]] = ..., predicted_capture_bytes: _Optional[int] = ..., graphs: _Optional[int] = ..., pools: _Optional[int] = ..., overhead_bytes: _Optional[int] = ..., live_bound_bytes: _Optional[int] = ...) -> None: ...

class PlannedBuffer(_message.Message):
    __slots__ = ("name", "start", "end", "size_bytes", "offset", "alias_group")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ALIAS_GROUP_FIELD_NUMBER: _ClassVar[int]
    name: str
    start: int
    end: int
    size_bytes: int
    offset: int
    alias_group: str
    def __init__(self, name: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., size_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., alias_group: _Optional[str] = ...) -> None: ...
