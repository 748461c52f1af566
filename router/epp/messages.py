"""Envoy ext_proc v3 messages as the picker reads and writes them (the `epp` extra's
compiled stubs, from xds-protos): what a `ProcessingRequest` says, and the few
`ProcessingResponse`s a picker answers with."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from router.epp.protocol import (
    DESTINATION_ENDPOINT,
    LB_NAMESPACE,
    SERVED_ENDPOINT,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)

Headers = list[tuple[bytes, bytes]]

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse

MAX_CHUNK = 62_000
"""Bytes of a body the picker sends Envoy per message (Envoy's gRPC messages are best kept
under 64 KiB, as the protocol's reference picker does)."""

# ProcessingMode.BodySendMode, as the stubs number it.
BODY_NONE, BODY_STREAMED, BODY_BUFFERED, BODY_BUFFERED_PARTIAL, BODY_FULL_DUPLEX = 0, 1, 2, 3, 4

_ATTRIBUTES = "envoy.filters.http.ext_proc"
"""The namespace of the attributes Envoy sends (`response_attributes: [upstream.address]`)."""


def header_pairs(headers: pb.HttpHeaders) -> Headers:
    """The headers as lower-case byte pairs (Envoy sends lower-case keys; a value is in
    `raw_value`, or in `value` from older senders)."""
    return [(h.key.encode("latin-1"), h.raw_value or h.value.encode("latin-1")) for h in headers.headers.headers]


def _string_list(value: struct_pb2.Value) -> list[str]:
    """A metadata value that lists endpoints: a string of comma-separated ones (a header
    copied to metadata) or a list of such strings (a control plane's)."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        items: Iterable[str] = [value.string_value]
    elif kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    else:
        return []
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


def subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the gateway lets the picker choose among (`envoy.lb.subset_hint`); None
    when it sets no hint (any endpoint of the pool), [] when it sets an empty one."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    return _string_list(namespace.fields[SUBSET_KEY])


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The endpoint that served the response: `x-gateway-destination-endpoint-served` in the
    `envoy.lb` metadata, else the upstream address attribute (gateways whose cluster sets
    no such metadata, e.g. ORIGINAL_DST); None when neither came (a reply of the gateway's own)."""
    namespace = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if namespace is not None and SERVED_ENDPOINT in namespace.fields:
        served = _string_list(namespace.fields[SERVED_ENDPOINT])
        if served:
            return served[0]
    attributes = request.attributes.get(_ATTRIBUTES)
    if attributes is not None and "upstream.address" in attributes.fields:
        address = _string_list(attributes.fields["upstream.address"])
        if address:
            return address[0]
    return None


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


# The picker's answers are encoded by hand: a dozen are sent per request, on the gateway's
# critical path, and building them as nested message objects cost several times more
# (`tests/epp/test_picker.py` checks each against what protobuf encodes). Field numbers:
# ProcessingResponse{request_headers 1, response_headers 2, request_body 3, response_body 4,
# dynamic_metadata 8}, HeadersResponse/BodyResponse{response 1},
# CommonResponse{header_mutation 2, body_mutation 3}, HeaderMutation{set_headers 1,
# remove_headers 2}, HeaderValueOption{header 1}, HeaderValue{key 1, raw_value 3},
# BodyMutation{body 1, streamed_response 3}, StreamedBodyResponse{body 1, end_of_stream 2},
# Struct{fields 1: entries {key 1, value 2}}, Value{string_value 3, struct_value 5}.


def _header(key: bytes, value: bytes) -> bytes:
    """HeaderMutation.set_headers[]: HeaderValueOption{header: HeaderValue{key, raw_value}}."""
    return _field(1, _field(1, _field(1, key) + _field(3, value)))


def header_mutation(set_headers: Headers, remove_headers: Sequence[str] = ()) -> bytes:
    return b"".join(_header(k, v) for k, v in set_headers) + b"".join(_field(2, k.encode("latin-1")) for k in remove_headers)


def route_headers(endpoints: Sequence[str], body_length: int | None, set_headers: Headers, remove_headers: Sequence[str]) -> bytes:
    """The request's header changes (a serialized HeaderMutation): the destination list, the
    replaced body's length, and the edits the router makes on the way to a worker."""
    edits: Headers = [(DESTINATION_ENDPOINT.encode(), ",".join(endpoints).encode())]
    if body_length is not None:
        edits.append((b"content-length", str(body_length).encode()))
    return header_mutation([*edits, *set_headers], remove_headers)


def _struct(fields: dict[str, bytes]) -> bytes:
    """A google.protobuf.Struct of already encoded Values."""
    return b"".join(_field(1, _field(1, key.encode()) + _field(2, value)) for key, value in fields.items())


def destination_metadata(endpoints: Sequence[str]) -> bytes:
    """`envoy.lb` dynamic metadata (a serialized Struct) naming the same endpoints as the
    header: the protocol asks for both, with one value."""
    inner = _struct({DESTINATION_ENDPOINT: _field(3, ",".join(endpoints).encode())})
    return _struct({LB_NAMESPACE: _field(5, inner)})


def request_headers_response(mutation: bytes | None = None, metadata: bytes | None = None) -> bytes:
    out = _field(1, _field(1, _field(2, mutation) if mutation is not None else b""))
    if metadata is not None:
        out += _field(8, metadata)
    return out


_END_OF_STREAM = _varint(2 << 3 | 0) + b"\x01"  # StreamedBodyResponse.end_of_stream = true


def streamed_body(chunk: bytes, *, request: bool, end: bool) -> bytes:
    """One serialized ProcessingResponse carrying `chunk` as a FULL_DUPLEX_STREAMED body
    response: {request,response}_body > BodyResponse.response > CommonResponse.body_mutation
    > BodyMutation.streamed_response > StreamedBodyResponse{body, end_of_stream}."""
    inner = (_field(1, chunk) if chunk else b"") + (_END_OF_STREAM if end else b"")
    return _field(3 if request else 4, _field(1, _field(3, _field(3, inner))))


def streamed_bodies(body: bytes, *, request: bool, end: bool = True) -> list[bytes]:
    """`body` as serialized FULL_DUPLEX_STREAMED body responses (`streamed_response` chunks
    under `MAX_CHUNK` bytes), the last one ending the body if `end`."""
    if len(body) <= MAX_CHUNK:
        return [streamed_body(body, request=request, end=end)]
    pieces = [body[i : i + MAX_CHUNK] for i in range(0, len(body), MAX_CHUNK)]
    return [streamed_body(piece, request=request, end=end and i == len(pieces) - 1) for i, piece in enumerate(pieces)]


def buffered_request_body(body: bytes, mutation: bytes, metadata: bytes) -> bytes:
    """A BUFFERED request body's answer: the body replaced, and the headers (not yet sent
    upstream) edited in the same response."""
    common = _field(2, mutation) + _field(3, _field(1, body))
    return _field(3, _field(1, common)) + _field(8, metadata)


def unchanged_body(*, request: bool) -> bytes:
    """A STREAMED or BUFFERED body chunk let through as it is (an empty BodyResponse)."""
    return _field(3 if request else 4, b"")


def trailers_response(*, request: bool) -> bytes:
    return _field(5 if request else 6, b"")


def response_headers_response(set_headers: Headers) -> bytes:
    return _field(2, _field(1, _field(2, header_mutation(set_headers))))


def immediate_response(status: int, headers: Headers, body: bytes, details: str = "") -> pb.ProcessingResponse:
    """The gateway answers the client itself, with this status, headers and body."""
    options = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k.decode("latin-1"), raw_value=v)) for k, v in headers]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=pb.HeaderMutation(set_headers=options), body=body,
        details=details,
    ))  # fmt: skip


def request_kind(request: pb.ProcessingRequest) -> str | None:
    return request.WhichOneof("request")
