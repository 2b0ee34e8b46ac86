from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "shared")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shared: SharedRegion
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shared: _Optional[_Union[SharedRegion, _Mapping]] = ...) -> None: ...

class SharedRegion(_message.Message):
    __slots__ = ("offset",)
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    offset: int
    def __init__(self, offset: _Optional[int] = ...) -> None: ...

class ExpertKey(_message.Message):
    __slots__ = ("layer", "expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("model", "request_id", "layer", "experts", "counts", "hidden")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    hidden: Tensor
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ServerTiming(_message.Message):
    __slots__ = ("queue_seconds", "compute_seconds", "total_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    compute_seconds: float
    total_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("request_id", "hidden", "timing", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    hidden: Tensor
    timing: ServerTiming
    error: Status
    def __init__(self, request_id: _Optional[str] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., timing: _Optional[_Union[ServerTiming, _Mapping]] = ..., error: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message", "lacking")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LACKING_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    lacking: _containers.RepeatedCompositeFieldContainer[ExpertKey]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., lacking: _Optional[_Iterable[_Union[ExpertKey, _Mapping]]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("model", "experts")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    experts: _containers.RepeatedCompositeFieldContainer[ExpertKey]
    def __init__(self, model: _Optional[str] = ..., experts: _Optional[_Iterable[_Union[ExpertKey, _Mapping]]] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("bytes_loaded", "seconds", "held", "device_bytes")
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes_loaded: int
    seconds: float
    held: _containers.RepeatedCompositeFieldContainer[ExpertKey]
    device_bytes: int
    def __init__(self, bytes_loaded: _Optional[int] = ..., seconds: _Optional[float] = ..., held: _Optional[_Iterable[_Union[ExpertKey, _Mapping]]] = ..., device_bytes: _Optional[int] = ...) -> None: ...

class UnloadRequest(_message.Message):
    __slots__ = ("model", "experts")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    experts: _containers.RepeatedCompositeFieldContainer[ExpertKey]
    def __init__(self, model: _Optional[str] = ..., experts: _Optional[_Iterable[_Union[ExpertKey, _Mapping]]] = ...) -> None: ...

class UnloadResponse(_message.Message):
    __slots__ = ("bytes_freed", "held", "device_bytes")
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes_freed: int
    held: _containers.RepeatedCompositeFieldContainer[ExpertKey]
    device_bytes: int
    def __init__(self, bytes_freed: _Optional[int] = ..., held: _Optional[_Iterable[_Union[ExpertKey, _Mapping]]] = ..., device_bytes: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model", "arch", "dtype", "hidden_size", "device", "held", "max_message_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    arch: str
    dtype: DType
    hidden_size: int
    device: str
    held: _containers.RepeatedCompositeFieldContainer[ExpertKey]
    max_message_bytes: int
    def __init__(self, model: _Optional[str] = ..., arch: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., hidden_size: _Optional[int] = ..., device: _Optional[str] = ..., held: _Optional[_Iterable[_Union[ExpertKey, _Mapping]]] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("shape", "handle", "storage_bytes", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class DeviceAttachRequest(_message.Message):
    __slots__ = ("model", "gpu_uuid", "dtype", "rows", "ends", "out", "flags")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    model: str
    gpu_uuid: str
    dtype: DType
    rows: CudaIpcBuffer
    ends: CudaIpcBuffer
    out: CudaIpcBuffer
    flags: CudaIpcBuffer
    def __init__(self, model: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., rows: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ..., ends: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ..., out: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ..., flags: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ...) -> None: ...

class DeviceAttachResponse(_message.Message):
    __slots__ = ("socket", "token")
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    socket: str
    token: bytes
    def __init__(self, socket: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("address", "replicas", "weight")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    address: str
    replicas: int
    weight: float
    def __init__(self, address: _Optional[str] = ..., replicas: _Optional[int] = ..., weight: _Optional[float] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("bundle", "experts", "endpoints")
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    bundle: str
    experts: _containers.RepeatedCompositeFieldContainer[ExpertKey]
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    def __init__(self, bundle: _Optional[str] = ..., experts: _Optional[_Iterable[_Union[ExpertKey, _Mapping]]] = ..., endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ...) -> None: ...

class RoutingTable(_message.Message):
    __slots__ = ("model", "version", "routes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    routes: _containers.RepeatedCompositeFieldContainer[Route]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., routes: _Optional[_Iterable[_Union[Route, _Mapping]]] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layer", "expert", "tokens", "tokens_per_second", "predicted_tokens", "predicted_tokens_per_second")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    tokens: int
    tokens_per_second: float
    predicted_tokens: int
    predicted_tokens_per_second: float
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., tokens: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., predicted_tokens: _Optional[int] = ..., predicted_tokens_per_second: _Optional[float] = ...) -> None: ...

class LayerPrediction(_message.Message):
    __slots__ = ("layer", "source_layer", "accuracy", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_LAYER_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    source_layer: int
    accuracy: float
    tokens: int
    def __init__(self, layer: _Optional[int] = ..., source_layer: _Optional[int] = ..., accuracy: _Optional[float] = ..., tokens: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("model", "frontend", "window_start", "window_seconds", "tokens", "loads", "predictions", "predictor", "prediction_distance", "offload", "passes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_FIELD_NUMBER: _ClassVar[int]
    WINDOW_START_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_DISTANCE_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    model: str
    frontend: str
    window_start: float
    window_seconds: float
    tokens: int
    loads: _containers.RepeatedCompositeFieldContainer[ExpertLoad]
    predictions: _containers.RepeatedCompositeFieldContainer[LayerPrediction]
    predictor: str
    prediction_distance: int
    offload: OffloadStats
    passes: int
    def __init__(self, model: _Optional[str] = ..., frontend: _Optional[str] = ..., window_start: _Optional[float] = ..., window_seconds: _Optional[float] = ..., tokens: _Optional[int] = ..., loads: _Optional[_Iterable[_Union[ExpertLoad, _Mapping]]] = ..., predictions: _Optional[_Iterable[_Union[LayerPrediction, _Mapping]]] = ..., predictor: _Optional[str] = ..., prediction_distance: _Optional[int] = ..., offload: _Optional[_Union[OffloadStats, _Mapping]] = ..., passes: _Optional[int] = ...) -> None: ...

class OffloadStats(_message.Message):
    __slots__ = ("activated", "hits", "prefetched", "prefetch_used", "loaded", "bytes_copied", "gpu_tokens", "cpu_tokens", "hit_rate", "prefetch_accuracy", "cpu_share", "policy", "cpu_experts")
    ACTIVATED_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_USED_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    GPU_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CPU_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    CPU_SHARE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    CPU_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    activated: int
    hits: int
    prefetched: int
    prefetch_used: int
    loaded: int
    bytes_copied: int
    gpu_tokens: int
    cpu_tokens: int
    hit_rate: float
    prefetch_accuracy: float
    cpu_share: float
    policy: str
    cpu_experts: int
    def __init__(self, activated: _Optional[int] = ..., hits: _Optional[int] = ..., prefetched: _Optional[int] = ..., prefetch_used: _Optional[int] = ..., loaded: _Optional[int] = ..., bytes_copied: _Optional[int] = ..., gpu_tokens: _Optional[int] = ..., cpu_tokens: _Optional[int] = ..., hit_rate: _Optional[float] = ..., prefetch_accuracy: _Optional[float] = ..., cpu_share: _Optional[float] = ..., policy: _Optional[str] = ..., cpu_experts: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "stop", "max_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    max_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "request_id", "prompt", "prompt_ids", "sampling")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    prompt: str
    prompt_ids: TokenIds
    sampling: SamplingParams
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...
