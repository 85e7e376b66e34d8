"""Services tier: real processes, real gRPC / HTTP servers, a real etcd."""
