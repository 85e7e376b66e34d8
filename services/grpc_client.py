"""A reflection-based gRPC client for debugging (there is no grpcurl here).

strata grpc list                                  services of the server
strata grpc describe strata.v1.Strata             its methods with request/response types
strata grpc call strata.v1.Strata/GetModelInfo '{}'
"""

from __future__ import annotations

import sys

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc


class Reflector:
    """Fetches descriptors from a server's reflection service into a private pool."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        self.pool = descriptor_pool.DescriptorPool()
        self._loaded: set[str] = set()

    def _ask(self, req: reflection_pb2.ServerReflectionRequest) -> reflection_pb2.ServerReflectionResponse:
        return next(iter(self._stub.ServerReflectionInfo(iter([req]))))

    def services(self) -> list[str]:
        resp = self._ask(reflection_pb2.ServerReflectionRequest(list_services=""))
        return [s.name for s in resp.list_services_response.service]

    def load_symbol(self, symbol: str) -> None:
        resp = self._ask(reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol))
        files = [
            descriptor_pb2.FileDescriptorProto.FromString(b)
            for b in resp.file_descriptor_response.file_descriptor_proto
        ]
        pending = {f.name: f for f in files}
        while pending:  # add dependencies before dependants
            progressed = False
            for name, f in list(pending.items()):
                if all(d in self._loaded or d not in pending for d in f.dependency):
                    if name not in self._loaded:
                        self.pool.Add(f)
                        self._loaded.add(name)
                    del pending[name]
                    progressed = True
            if not progressed:
                raise RuntimeError(f"cannot resolve descriptors for {symbol}")


def run_reflection_command(address: str, action: str, target: str, body: str) -> int:
    with grpc.insecure_channel(address) as channel:
        r = Reflector(channel)
        if action == "list":
            print("\n".join(r.services()))
            return 0
        service_name, _, method_name = target.partition("/")
        if not service_name:
            print("strata grpc: give a service (describe) or Service/Method (call)", file=sys.stderr)
            return 2
        r.load_symbol(service_name)
        service = r.pool.FindServiceByName(service_name)
        if action == "describe":
            for m in service.methods:
                stream = "stream " if m.server_streaming else ""
                print(f"rpc {m.name}({m.input_type.full_name}) returns ({stream}{m.output_type.full_name})")
            return 0
        method = service.methods_by_name[method_name]
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        request = json_format.Parse(body, req_cls())
        path = f"/{service.full_name}/{method.name}"
        kwargs = {
            "request_serializer": req_cls.SerializeToString,
            "response_deserializer": resp_cls.FromString,
        }
        if method.server_streaming:
            for resp in channel.unary_stream(path, **kwargs)(request):
                print(json_format.MessageToJson(resp, indent=None))
        else:
            print(json_format.MessageToJson(channel.unary_unary(path, **kwargs)(request), indent=None))
        return 0
