"""A reflection-based gRPC client for debugging (there is no grpcurl here).

strata grpc list                                  services of the server
strata grpc describe strata.v1.Strata             its methods with request/response types
strata grpc call strata.v1.Strata/GetModelInfo '{}'

Descriptors come from the server's reflection service through grpcio-reflection's
``ProtoReflectionDescriptorDatabase``; JSON goes through protobuf's ``json_format``. A failure is
one line on stderr: status 1 when the server or the connection fails, 2 for a bad command.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

Metadata = Sequence[tuple[str, str]] | None  # (key, value) pairs sent with a call


class UsageError(Exception):
    """The command names something the server lacks, or a request it cannot send."""


def run_reflection_command(address: str, action: str, target: str, body: str, *, metadata: Metadata = None) -> int:
    """``metadata`` goes with ``call`` (e.g. ``authorization: Bearer <key>``); reflection is open."""
    try:
        with grpc.insecure_channel(address) as channel:
            _run(channel, action, target, body, metadata)
    except (UsageError, grpc.RpcError) as e:  # an RpcError: unreachable, unauthenticated, the server's status
        why = str(e) if isinstance(e, UsageError) else f"{e.code().name}: {e.details()}"
        print("strata grpc:", " ".join(why.split()), file=sys.stderr)  # one line, whatever the library wrote
        return 2 if isinstance(e, UsageError) else 1
    return 0


def _run(channel: grpc.Channel, action: str, target: str, body: str, metadata: Metadata) -> None:
    db = ProtoReflectionDescriptorDatabase(channel)
    if action == "list":
        print("\n".join(db.get_services()))
        return
    service_name, _, method_name = target.partition("/")
    if not service_name:
        raise UsageError("give a service (describe) or Service/Method (call)")
    pool = descriptor_pool.DescriptorPool(db)
    try:
        service = pool.FindServiceByName(service_name)
    except KeyError:
        raise UsageError(f"unknown service {service_name}; services: {', '.join(db.get_services())}") from None
    if action == "describe":
        for m in [_method(service, method_name)] if method_name else service.methods:
            stream_in, stream_out = ("stream " if s else "" for s in (m.client_streaming, m.server_streaming))
            print(f"rpc {m.name}({stream_in}{m.input_type.full_name}) returns ({stream_out}{m.output_type.full_name})")
        return
    method = _method(service, method_name)
    if method.client_streaming:
        raise UsageError(f"{service_name}/{method.name} takes a request stream; call sends one request")
    req_cls = message_factory.GetMessageClass(method.input_type)
    resp_cls = message_factory.GetMessageClass(method.output_type)
    try:
        request = json_format.Parse(body, req_cls(), descriptor_pool=pool)
    except json_format.ParseError as e:
        raise UsageError(f"request is not a {method.input_type.full_name}: {e}") from None
    kind = channel.unary_stream if method.server_streaming else channel.unary_unary
    rpc = kind(f"/{service.full_name}/{method.name}", request_serializer=req_cls.SerializeToString,
               response_deserializer=resp_cls.FromString)
    answer = rpc(request, metadata=metadata)
    for resp in answer if method.server_streaming else [answer]:
        print(json_format.MessageToJson(resp, indent=None, descriptor_pool=pool), flush=True)


def _method(service: ServiceDescriptor, name: str) -> MethodDescriptor:
    if name not in service.methods_by_name:
        raise UsageError(f"no method {name!r} in {service.full_name}; methods: {', '.join(service.methods_by_name)}")
    return service.methods_by_name[name]
