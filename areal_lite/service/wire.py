"""The Tinker API's request and response bodies, as the `tinker` SDK sends and reads them.

``forward_backward`` requests arrive as protobuf (``tinker.proto.tinker_public_pb2``,
``Content-Type: application/x-protobuf``, zstd-compressed when ``Content-Encoding: zstd``) or as
JSON (the SDK's pydantic shapes: older SDKs and plain HTTP clients); every other request is JSON.
``ForwardBackwardOutput`` and ``SampleResponse`` go back as protobuf to a client that accepts it
(the SDK always does for those two) and as JSON otherwise.

What a request carries is decoded here into plain values (`Datum`: token ids, numpy arrays,
provenance spans) that the rest of the service works with; nothing below this module sees a
protobuf message. Inputs the service cannot serve (images, audio) raise `Unsupported`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from aiohttp import web

PROTOBUF = "application/x-protobuf"


class BadRequest(ValueError):
    """A request the service cannot accept as sent (the client's error)."""


class Unsupported(BadRequest):
    """A request for something this service does not do (images, audio, custom server losses)."""


@dataclass(frozen=True)
class Span:
    """One provenance run: datum positions ``[offset, offset + length)`` of a sampled sequence's
    prompt (``prompt``) or of its sampled tokens (``sampled``)."""

    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


@dataclass
class Datum:
    """One training example: ``tokens`` (the model input, N ids), ``inputs`` (the loss inputs by
    name, each an array whose first dimension is N) and, when given, the provenance of the loss
    rows (``target_spans``, tiling ``target_tokens``)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]
    target_spans: list[Span] = field(default_factory=list)


@dataclass
class ForwardBackwardCall:
    """A ``forward_backward`` request: its envelope, decoded at once, and its data, decoded by
    `data` (on the engine thread: a request whose data the service cannot take still holds its
    place in the client's order, and fails as its turn comes)."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    raw_data: list[object]
    """The data as sent: protobuf ``Datum`` messages or JSON objects."""

    def data(self) -> list[Datum]:
        return [_datum_from_json(d) if isinstance(d, dict) else _datum_from_proto(d) for d in self.raw_data]


# ---------------------------------------------------------------------------------- tensors


def _pb():  # the SDK's generated module; imported where used (protobuf import costs ~0.3 s)
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _proto_dtypes() -> dict[int, np.dtype]:
    pb = _pb()
    return {
        pb.DTYPE_FLOAT32: np.dtype(np.float32),
        pb.DTYPE_INT64: np.dtype(np.int64),
        pb.DTYPE_INT32: np.dtype(np.int32),
        pb.DTYPE_BFLOAT16: np.dtype(np.uint16),
    }


def _dense(values: np.ndarray, shape: list[int], crow: list[int] | None, col: list[int] | None) -> np.ndarray:
    """A dense array of ``shape`` from flat ``values``, or from a CSR layout (absent entries 0)."""
    if crow is None:
        if shape and int(np.prod(shape)) != values.size:
            raise BadRequest(f"a tensor of shape {shape} cannot hold {values.size} values")
        return values.reshape(shape) if shape else values
    if len(shape) != 2 or col is None or len(col) != values.size or len(crow) != shape[0] + 1:
        raise BadRequest("a sparse CSR tensor needs a 2-D shape, nrows + 1 row pointers and one column per value")
    out = np.zeros(shape, dtype=values.dtype)
    for row in range(shape[0]):
        start, end = crow[row], crow[row + 1]
        out[row, col[start:end]] = values[start:end]
    return out


def tensor_from_proto(msg: object) -> np.ndarray:
    """A ``Tensor`` message as a numpy array (int64 or float32; bf16 widened, CSR made dense)."""
    dtype = _proto_dtypes().get(msg.dtype)  # type: ignore[attr-defined]
    if dtype is None:
        raise BadRequest(f"unsupported tensor dtype {msg.dtype}")  # type: ignore[attr-defined]
    shape = list(msg.shape)  # type: ignore[attr-defined]
    if msg.HasField("sparse_csr"):  # type: ignore[attr-defined]
        csr = msg.sparse_csr  # type: ignore[attr-defined]
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64).tolist()
        col = np.frombuffer(csr.col_indices, dtype=np.int64).tolist()
    else:
        values, crow, col = np.frombuffer(msg.dense, dtype=dtype), None, None  # type: ignore[attr-defined]
    return _widen(_dense(values, shape, crow, col), bf16=dtype == np.uint16)


def _widen(a: np.ndarray, bf16: bool = False) -> np.ndarray:
    if bf16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    if a.dtype.kind in "iu":
        return a.astype(np.int64)
    return a.astype(np.float32)


def tensor_from_json(obj: object, name: str) -> np.ndarray:
    """A ``TensorData`` JSON object (``data``, ``dtype``, ``shape``, optional CSR) as numpy."""
    if not isinstance(obj, dict) or "data" not in obj:
        raise BadRequest(f"loss_fn_inputs[{name!r}] must be a TensorData object with data, dtype and shape")
    dtype = {"int64": np.int64, "float32": np.float32}.get(str(obj.get("dtype")))
    if dtype is None:
        raise BadRequest(f"loss_fn_inputs[{name!r}]: dtype must be int64 or float32, got {obj.get('dtype')!r}")
    values = np.asarray(obj["data"], dtype=dtype)
    shape = list(obj.get("shape") or [values.size])
    return _widen(_dense(values, shape, obj.get("sparse_crow_indices"), obj.get("sparse_col_indices")))


# ---------------------------------------------------------------------------------- model inputs


def _unsupported_chunk(kind: str) -> Unsupported:
    return Unsupported(
        f"model_input holds a {kind} chunk: this service serves text models; send token ids (EncodedTextChunk)"
    )


def tokens_from_json_chunks(chunks: object) -> list[int]:
    """The token ids of a JSON ``ModelInput``'s chunks (text only)."""
    if not isinstance(chunks, list):
        raise BadRequest("model_input.chunks must be a list")
    tokens: list[int] = []
    for chunk in chunks:
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise _unsupported_chunk(str(kind))
        tokens.extend(int(t) for t in chunk["tokens"])
    return tokens


def model_input_tokens(model_input: object) -> list[int]:
    """Token ids of a JSON ``ModelInput`` (``{"chunks": [...]}``)."""
    if not isinstance(model_input, dict):
        raise BadRequest("model_input must be an object with chunks")
    return tokens_from_json_chunks(model_input.get("chunks"))


def _span_from_proto(msg: object) -> Span:
    which = msg.WhichOneof("span")  # type: ignore[attr-defined]
    if which is None:
        raise BadRequest("a provenance span names neither prompt_tokens nor sampled_tokens")
    arm = getattr(msg, which)
    return Span("prompt" if which == "prompt_tokens" else "sampled", arm.sequence_id, arm.offset, arm.length)


def _datum_from_proto(msg: object) -> Datum:
    tokens: list[int] = []
    for chunk in msg.model_input:  # type: ignore[attr-defined]
        which = chunk.WhichOneof("chunk")
        if which != "encoded_text":
            raise _unsupported_chunk(str(which))
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    inputs = {name: tensor_from_proto(t) for name, t in msg.loss_fn_inputs.items()}  # type: ignore[attr-defined]
    spans = [_span_from_proto(s) for s in msg.loss_fn_input_spans]  # type: ignore[attr-defined]
    return Datum(tokens, inputs, spans)


def _datum_from_json(obj: object) -> Datum:
    if not isinstance(obj, dict):
        raise BadRequest("each datum must be an object with model_input and loss_fn_inputs")
    inputs = obj.get("loss_fn_inputs") or {}
    if not isinstance(inputs, dict):
        raise BadRequest("loss_fn_inputs must be an object")
    if obj.get("loss_fn_input_spans"):
        raise Unsupported("provenance spans are read from protobuf requests only (the SDK's encoding)")
    return Datum(model_input_tokens(obj.get("model_input")), {k: tensor_from_json(v, k) for k, v in inputs.items()})


def decompress(body: bytes, encoding: str | None) -> bytes:
    """``body`` without its ``Content-Encoding`` (zstd, or none)."""
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise BadRequest(f"unsupported Content-Encoding {encoding!r} (zstd or none)")
    import zstandard

    try:
        # The SDK's compressor writes the content size in the frame header; without it, stream.
        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    except zstandard.ZstdError as e:
        raise BadRequest(f"zstd body does not decompress: {e}") from e


def forward_backward_call(body: bytes, content_type: str, forward_only: bool = False) -> ForwardBackwardCall:
    """Decode a ``forward_backward`` (or, with ``forward_only``, a legacy JSON ``forward``) body."""
    if PROTOBUF in content_type:
        from google.protobuf.message import DecodeError

        msg = _pb().ForwardBackwardRequest()
        try:
            msg.ParseFromString(body)
        except DecodeError as e:
            raise BadRequest(f"body is not a ForwardBackwardRequest protobuf: {e}") from e
        config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
        for key, value in msg.loss_fn_config_v2.items():
            config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
        return ForwardBackwardCall(
            msg.model_id, int(msg.seq_id), msg.loss_fn, config, forward_only or bool(msg.forward_only), list(msg.data)
        )
    obj = json_object(body)
    spec = obj.get("forward_backward_input") or obj.get("forward_input")
    if not isinstance(spec, dict):
        raise BadRequest("a JSON forward_backward body needs forward_backward_input (data, loss_fn)")
    config = spec.get("loss_fn_config") or {}
    if not isinstance(config, dict):
        raise BadRequest("loss_fn_config must be an object")
    data = spec.get("data") or []
    if not isinstance(data, list):
        raise BadRequest("forward_backward_input.data must be a list of datums")
    return ForwardBackwardCall(
        str(obj.get("model_id", "")),
        int(obj.get("seq_id") or 0),  # type: ignore[call-overload]
        str(spec.get("loss_fn", "")),
        config,
        forward_only or bool(obj.get("forward_only", False)),
        [d if isinstance(d, dict) else {"invalid": d} for d in data],
    )


def json_object(body: bytes) -> dict[str, object]:
    """A JSON request body, which must be an object; BadRequest otherwise."""
    try:
        obj = json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not JSON: {e}") from e
    if not isinstance(obj, dict):
        raise BadRequest("the body must be a JSON object")
    return obj


def str_field(body: dict[str, object], key: str) -> str:
    """``body[key]``, which must be a non-empty string; BadRequest otherwise."""
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{key} must be a non-empty string")
    return value


def int_field(body: dict[str, object], key: str, default: int | None = None) -> int:
    """``body[key]`` (``default`` when absent), which must be an integer; BadRequest otherwise."""
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be an integer")
    return value


def json_response(body: object, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


def error_response(message: str, status: int = 400) -> web.Response:
    """The client's error, as the SDK reads it: ``{error, category: "user"}``."""
    return json_response({"error": message, "category": "user"}, status)


# ---------------------------------------------------------------------------------- responses


@dataclass
class Sequence:
    """One sampled sequence: its tokens, their log-probabilities, why it stopped and, when asked
    for, the top-k (ids, log-probs) ``[n, k]`` at each sampled position."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class Samples:
    """A sampling request's result: its sequences and, when asked for, the prompt's log-probs
    (NaN where none was computed) and top-k at each prompt position."""

    sequences: list[Sequence]
    prompt_logprobs: np.ndarray | None = None
    prompt_topk: tuple[np.ndarray, np.ndarray] | None = None


def _topk_proto(topk: tuple[np.ndarray, np.ndarray]) -> object:
    ids, lps = topk
    return _pb().TopkLogprobs(
        token_ids=ids.astype(np.int32).tobytes(),
        logprobs=lps.astype(np.float32).tobytes(),
        k=int(ids.shape[1]),
        length=int(ids.shape[0]),
    )


def samples_proto(s: Samples) -> bytes:
    pb = _pb()
    msg = pb.SampleResponse()
    for seq in s.sequences:
        out = msg.sequences.add()
        out.stop_reason = pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        out.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk is not None:
            out.topk_sampled_logprobs.CopyFrom(_topk_proto(seq.topk))
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs.astype(np.float32).tobytes()
    if s.prompt_topk is not None:
        msg.topk_prompt_logprobs.CopyFrom(_topk_proto(s.prompt_topk))
    return msg.SerializeToString()


def _topk_json(topk: tuple[np.ndarray, np.ndarray]) -> list[list[tuple[int, float]]]:
    return [list(zip(i.tolist(), lp.tolist())) for i, lp in zip(*topk)]


def samples_json(s: Samples) -> dict[str, object]:
    out: dict[str, object] = {
        "type": "sample",
        "sequences": [
            {
                "stop_reason": seq.stop_reason,
                "tokens": seq.tokens,
                "logprobs": seq.logprobs,
                **({"topk_logprobs": _topk_json(seq.topk)} if seq.topk is not None else {}),
            }
            for seq in s.sequences
        ],
    }
    if s.prompt_logprobs is not None:
        out["prompt_logprobs"] = [None if np.isnan(v) else float(v) for v in s.prompt_logprobs]
    if s.prompt_topk is not None:
        out["topk_prompt_logprobs"] = _topk_json(s.prompt_topk)
    return out


@dataclass
class ForwardBackwardResult:
    """Per-datum output arrays (each ``[N]``, float32) by name, and the call's metrics
    (``name:reduction`` keys, as the SDK combines chunks' metrics by the reduction)."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]


OUTPUT_TYPE = "ArrayRecord"


def forward_backward_proto(r: ForwardBackwardResult) -> bytes:
    """A ``ForwardBackwardOutput`` with one ``ArrayRecord``: each field's per-datum arrays
    concatenated, with byte offsets."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=OUTPUT_TYPE, metrics=r.metrics)
    record = msg.loss_fn_outputs.add(type_tag=OUTPUT_TYPE, num_datums=len(r.outputs))
    for name in r.outputs[0] if r.outputs else []:
        arrays = [o[name].astype(np.float32).reshape(-1) for o in r.outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        field_msg = record.fields[name]
        field_msg.data = b"".join(a.tobytes() for a in arrays)
        field_msg.offsets = offsets.tobytes()
        field_msg.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


def forward_backward_json(r: ForwardBackwardResult) -> dict[str, object]:
    return {
        "loss_fn_output_type": OUTPUT_TYPE,
        "loss_fn_outputs": [
            {
                name: {"data": a.astype(np.float32).tolist(), "dtype": "float32", "shape": list(a.shape)}
                for name, a in o.items()
            }
            for o in r.outputs
        ],
        "metrics": r.metrics,
    }
