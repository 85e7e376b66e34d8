"""Exit 0 when the gRPC server at ADDRESS reports SERVING (used by compose health checks).

    python -m services.healthcheck HOST:PORT [--tls-ca CA --tls-cert CERT --tls-key KEY]

With ``--tls-ca`` the check connects over TLS, presenting the certificate when given (Strata's
internal servers require one signed by the CA; the public port does not).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _channel(address: str, ca: str, cert: str, key: str) -> grpc.Channel:
    if not ca:
        return grpc.insecure_channel(address)
    creds = grpc.ssl_channel_credentials(
        Path(ca).read_bytes(), Path(key).read_bytes() if key else None, Path(cert).read_bytes() if cert else None
    )
    return grpc.secure_channel(address, creds)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m services.healthcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("address", nargs="?", default="127.0.0.1:50051")
    ap.add_argument("--tls-ca", default="", help="CA of the server's certificate (PEM); empty = plaintext")
    ap.add_argument("--tls-cert", default="", help="client certificate (PEM) to present")
    ap.add_argument("--tls-key", default="", help="its private key (PEM)")
    a = ap.parse_args(argv)
    try:
        with _channel(a.address, a.tls_ca, a.tls_cert, a.tls_key) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    except grpc.RpcError as e:
        print(f"{a.address}: {e.code().name}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:  # an unreadable certificate file
        print(f"{a.address}: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1)


if __name__ == "__main__":
    main()
