from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DispatchRequest(_message.Message):
    __slots__ = ("layer", "placement_version", "hidden", "slot", "weight")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    placement_version: int
    hidden: Tensor
    slot: Tensor
    weight: Tensor
    def __init__(self, layer: _Optional[int] = ..., placement_version: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., slot: _Optional[_Union[Tensor, _Mapping]] = ..., weight: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class DispatchResponse(_message.Message):
    __slots__ = ("output", "compute_seconds")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    compute_seconds: float
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class DispatchStreamResponse(_message.Message):
    __slots__ = ("output", "compute_seconds", "error_code", "error_message")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    compute_seconds: float
    error_code: int
    error_message: str
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., compute_seconds: _Optional[float] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class LayerSlots(_message.Message):
    __slots__ = ("layer", "logical_expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    logical_expert: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., logical_expert: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadSlotsRequest(_message.Message):
    __slots__ = ("version", "layers", "peers")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerSlots]
    peers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerSlots, _Mapping]]] = ..., peers: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadSlotsResponse(_message.Message):
    __slots__ = ("version", "bytes_read", "bytes_reused", "seconds", "bytes_from_peers", "bytes_written", "rows_added", "peak_extra_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_REUSED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FROM_PEERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    ROWS_ADDED_FIELD_NUMBER: _ClassVar[int]
    PEAK_EXTRA_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes_read: int
    bytes_reused: int
    seconds: float
    bytes_from_peers: int
    bytes_written: int
    rows_added: int
    peak_extra_bytes: int
    def __init__(self, version: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_reused: _Optional[int] = ..., seconds: _Optional[float] = ..., bytes_from_peers: _Optional[int] = ..., bytes_written: _Optional[int] = ..., rows_added: _Optional[int] = ..., peak_extra_bytes: _Optional[int] = ...) -> None: ...

class FetchExpertsRequest(_message.Message):
    __slots__ = ("layer", "logical_expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    logical_expert: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., logical_expert: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertWeights(_message.Message):
    __slots__ = ("layer", "logical_expert", "w13", "w2", "w13_scale", "w2_scale")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_EXPERT_FIELD_NUMBER: _ClassVar[int]
    W13_FIELD_NUMBER: _ClassVar[int]
    W2_FIELD_NUMBER: _ClassVar[int]
    W13_SCALE_FIELD_NUMBER: _ClassVar[int]
    W2_SCALE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    logical_expert: int
    w13: Tensor
    w2: Tensor
    w13_scale: Tensor
    w2_scale: Tensor
    def __init__(self, layer: _Optional[int] = ..., logical_expert: _Optional[int] = ..., w13: _Optional[_Union[Tensor, _Mapping]] = ..., w2: _Optional[_Union[Tensor, _Mapping]] = ..., w13_scale: _Optional[_Union[Tensor, _Mapping]] = ..., w2_scale: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ReleaseSlotsRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class ReleaseSlotsResponse(_message.Message):
    __slots__ = ("loaded_versions",)
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    loaded_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, loaded_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerStats(_message.Message):
    __slots__ = ("layer", "logical_expert", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_EXPERT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    logical_expert: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., logical_expert: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class VersionStats(_message.Message):
    __slots__ = ("version", "layers")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerStats]
    def __init__(self, version: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerStats, _Mapping]]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("current_version", "loaded_versions", "loading_versions", "versions", "dispatch_calls", "weight_bytes", "compute_seconds", "queue_seconds", "socket_port", "compute_slots", "refused")
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LOADING_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_CALLS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PORT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    loaded_versions: _containers.RepeatedScalarFieldContainer[int]
    loading_versions: _containers.RepeatedScalarFieldContainer[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionStats]
    dispatch_calls: int
    weight_bytes: int
    compute_seconds: float
    queue_seconds: float
    socket_port: int
    compute_slots: int
    refused: _containers.RepeatedCompositeFieldContainer[Refusal]
    def __init__(self, current_version: _Optional[int] = ..., loaded_versions: _Optional[_Iterable[int]] = ..., loading_versions: _Optional[_Iterable[int]] = ..., versions: _Optional[_Iterable[_Union[VersionStats, _Mapping]]] = ..., dispatch_calls: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., socket_port: _Optional[int] = ..., compute_slots: _Optional[int] = ..., refused: _Optional[_Iterable[_Union[Refusal, _Mapping]]] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("transport", "reason", "count")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    transport: str
    reason: str
    count: int
    def __init__(self, transport: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...
