"""``strata``: the command line — the only module that imports every service.

strata up --model DIR [--port 50051]        etcd + kvstore + worker + scheduler + tokenizer
strata serve SERVICE [flags]                one service (what compose runs)
strata generate "text" [--address ...]      a client of strata.v1.Strata
strata model tiny --arch qwen3 --size tiny --out DIR
strata grpc list|describe|call ...          a reflection-based client for debugging
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

SERVICES = ("tokenizer", "scheduler", "worker", "kvstore")


def _up(args: argparse.Namespace) -> int:
    from services import supervisor
    from services.client import generate_text

    model = Path(args.model)
    if not (model / "config.json").exists():
        print(
            f"strata up: {model} has no config.json; run `strata model tiny --out {model}` first",
            file=sys.stderr,
        )
        return 2
    run_dir = Path(args.run_dir or f".runs/{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"starting Strata for {model} (logs in {run_dir})")
    worker_args: tuple[str, ...] = ("--kv-cache-bytes", str(args.kv_cache_bytes))
    if args.host_cache_bytes:  # the hierarchical cache: host pool (L2) and the kvstore shards (L3)
        worker_args += ("--host-cache-bytes", str(args.host_cache_bytes), "--l3", "true")
    try:
        tokenizer_args: tuple[str, ...] = ("--api-key", args.api_key) if args.api_key else ()
        stack = supervisor.start_stack(
            model, args.port, run_dir, etcd=args.etcd, worker_args=worker_args,
            tokenizer_args=tokenizer_args, http_port=args.http_port,
        )
    except supervisor.StartError as e:
        print(f"strata up: {e}", file=sys.stderr)
        return 1
    address = stack.child("tokenizer").address
    if args.example:
        print(f'\nexample: strata generate --address {address} "{args.example}"')
        try:
            generate_text(address, args.example, max_new_tokens=24, temperature=0.0, out=sys.stdout)
        except Exception as e:  # the stack keeps serving; the user sees why the example failed
            print(f"example request failed: {e}", file=sys.stderr)
    http = stack.child("tokenizer").extra.get("http")
    if http:
        print(f"\nOpenAI-compatible API: http://{http}/v1 (model {model.name!r}), e.g.\n"
              f"  curl http://{http}/v1/completions -H 'content-type: application/json' "
              f"-d '{{\"model\": \"{model.name}\", \"prompt\": \"The cache\", \"max_tokens\": 16}}'")
    print(f"\nStrata is serving strata.v1.Strata on {address}. Ctrl-C stops all services.", flush=True)
    return supervisor.supervise(stack)


def _serve(args: argparse.Namespace, rest: list[str]) -> int:
    module = importlib.import_module(f"services.{args.service}.server")
    module.main(rest)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from services.client import generate_text

    generate_text(
        args.address,
        args.text,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        chat=args.chat,
        seed=args.seed,
        out=sys.stdout,
    )
    return 0


def _model(args: argparse.Namespace) -> int:
    from services.worker.tiny import write_tiny_checkpoint

    out = write_tiny_checkpoint(args.arch, args.size, Path(args.out), seed=args.seed)
    print(f"wrote {args.size} {args.arch} checkpoint to {out}")
    return 0


def _grpc(args: argparse.Namespace) -> int:
    from services.grpc_client import run_reflection_command

    return run_reflection_command(args.address, args.action, args.target, args.json)


def _bench(args: argparse.Namespace) -> int:
    from services.bench.cli import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata", description="Strata LLM inference server")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start etcd and all services on loopback")
    up.add_argument("--model", required=True, help="Hugging Face model directory")
    up.add_argument("--port", type=int, default=50051, help="public port of strata.v1.Strata")
    up.add_argument("--http-port", type=int, default=8000,
                    help="OpenAI-compatible HTTP port (0 = off, -1 = pick a free one)")
    up.add_argument("--api-key", default="", help="API keys (comma-separated) required by /v1/* and gRPC")
    up.add_argument("--etcd", default="", help="use this etcd endpoint instead of starting one")
    up.add_argument("--kv-cache-bytes", type=int, default=64 * 1024 * 1024, help="worker KV pool bytes")
    up.add_argument("--host-cache-bytes", type=int, default=256 * 1024 * 1024,
                    help="worker host (L2) pool bytes, with L3 on the kvstore; 0 = device cache only")
    up.add_argument("--run-dir", default="", help="where logs go (default .runs/<time>)")
    up.add_argument("--example", default="The cache", help="prompt of the example reply ('' = none)")

    serve = sub.add_parser("serve", help="run one service (flags: strata serve SERVICE --help)")
    serve.add_argument("service", choices=SERVICES)

    gen = sub.add_parser("generate", help="generate text through strata.v1.Strata")
    gen.add_argument("text")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="send the text as a user chat message")

    model = sub.add_parser("model", help="model utilities")
    msub = model.add_subparsers(dest="model_command", required=True)
    tiny = msub.add_parser("tiny", help="write a random-weight checkpoint with a trained BPE tokenizer")
    tiny.add_argument("--arch", choices=["qwen3", "qwen3-next"], default="qwen3")
    tiny.add_argument("--size", choices=["tiny", "bench"], default="tiny")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)

    from services.bench.cli import add_bench_parser  # light: no torch at import

    add_bench_parser(sub)

    g = sub.add_parser("grpc", help="reflection-based gRPC client (no grpcurl needed)")
    g.add_argument("action", choices=["list", "describe", "call"])
    g.add_argument("target", nargs="?", default="", help="service or Service/Method")
    g.add_argument("json", nargs="?", default="{}", help="request as JSON (call)")
    g.add_argument("--address", default="127.0.0.1:50051")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["serve"] and len(argv) >= 2 and argv[1] in SERVICES:
        # Everything after the service name belongs to the service's own parser.
        args = parser.parse_args(argv[:2])
        sys.exit(_serve(args, argv[2:]))
    args = parser.parse_args(argv)
    handlers = {"up": _up, "generate": _generate, "model": _model, "grpc": _grpc, "bench": _bench}
    sys.exit(handlers[args.command](args))


if __name__ == "__main__":
    main()
