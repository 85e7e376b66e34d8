"""Exit 0 when the gRPC server at ADDRESS reports SERVING (used by compose health checks)."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> None:
    address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    except grpc.RpcError as e:
        print(f"{address}: {e.code().name}", file=sys.stderr)
        sys.exit(1)
    sys.exit(0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1)


if __name__ == "__main__":
    main()
