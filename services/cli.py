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
import os
import sys
import time
from pathlib import Path

SERVICES = ("tokenizer", "scheduler", "worker", "kvstore")
# Long enough for whole host pages (64 tokens): with the hierarchical cache on, prefixes are cached
# in those pages, so a shorter prompt would show no reuse.
EXAMPLE = "Strata keeps the KV cache of every prompt it has seen. " * 8


def _stack_args(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """The flags ``strata up`` passes on, by service (only those the user set, plus the defaults
    that make ``strata up`` what it is: metrics on, the hierarchical cache on)."""

    def given(*pairs: tuple[str, object]) -> tuple[str, ...]:
        return tuple(x for flag, v in pairs if v not in (None, "") for x in (flag, str(v)))

    common = given(("--host", args.host), ("--log-level", args.log_level))
    if args.tls_files is not None:
        f = args.tls_files
        common += ("--tls-cert", f.cert, "--tls-key", f.key, "--tls-ca", f.ca)
    if args.metrics:
        common += ("--metrics-port", "0")
    if args.otlp_endpoint:
        common += ("--trace-exporter", "otlp", "--trace-target", args.otlp_endpoint)
    elif args.trace_exporter != "none":
        target = str(Path(args.run_dir_path) / "spans-{service}.jsonl") if args.trace_exporter == "file" else ""
        common += given(("--trace-exporter", args.trace_exporter), ("--trace-target", target))
    worker = given(
        ("--device", args.device), ("--dtype", args.dtype), ("--page-size", args.page_size),
        ("--kv-cache-bytes", args.kv_cache_bytes), ("--kv-mem-fraction", args.kv_mem_fraction),
        ("--max-context", args.context_length), ("--max-rows", args.max_running), ("--tp", args.tp),
    )
    if args.host_cache_bytes not in ("0", 0):  # the hierarchical cache: host pool (L2) and kvstore (L3)
        worker += ("--host-cache-bytes", str(args.host_cache_bytes), "--l3", "true")
    scheduler = given(
        ("--max-running", args.max_running), ("--max-prefill-tokens", args.max_prefill_tokens),
        ("--max-waiting", args.max_waiting), ("--speculative-algorithm", args.speculative_algorithm),
        ("--speculative-num-draft-tokens", args.speculative_num_draft_tokens),
    )
    if args.speculative_draft_model:
        worker += ("--speculative-draft-model", args.speculative_draft_model)
        if not args.speculative_algorithm:
            scheduler += ("--speculative-algorithm", "draft")
    if args.speculative_algorithm == "mtp":
        worker += ("--speculative-mtp", "true")
    tokenizer = given(("--api-key", args.api_key), ("--api-key-file", args.api_key_file),
                      ("--model-name", args.served_model_name), ("--router-policy", args.router_policy),
                      ("--tool-call-parser", args.tool_call_parser), ("--reasoning-parser", args.reasoning_parser),
                      ("--front-processes", args.front_processes))
    return {"common": common, "worker": worker, "scheduler": scheduler, "tokenizer": tokenizer}


def _replica_worker_args(args: argparse.Namespace, roles: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Each replica's own worker flags: its CPUs (``--worker-cpus``), its forward threads
    (``--worker-threads``), a prefill worker's outbox."""
    n = len(roles) or args.replicas
    cpus = args.worker_cpus.split(";") if args.worker_cpus else []
    threads = args.worker_threads.split(";") if args.worker_threads else []
    own: list[tuple[str, ...]] = [("--cpus", cpus[i]) if cpus else () for i in range(n)]
    for i, t in enumerate(threads):
        own[i] += ("--threads", t.strip())
    for i, role in enumerate(roles):
        if role == "prefill" and args.handoff_outbox_bytes:
            own[i] += ("--outbox-bytes", args.handoff_outbox_bytes)
    return own


def _shared_cores_note(args: argparse.Namespace, roles: tuple[str, ...]) -> str:
    """A hint when prefill and decode workers will share this host's cores on the CPU, each taking
    every core (no ``--worker-cpus``, no ``--worker-threads``): "" otherwise."""
    if not roles or args.worker_cpus or args.worker_threads or (args.device or "cpu") != "cpu":
        return ""
    cores = len(os.sched_getaffinity(0))
    decode = ";".join("0" if r == "prefill" else str(max(1, cores // len(roles))) for r in roles)
    return (f"note: the {len(roles)} workers share this host's {cores} cores, each with a forward thread per "
            f"core, so decode steps wait on prefill threads; --worker-threads '{decode}' or --worker-cpus "
            "gives the decode workers room (docs/operations.md: Prefill and decode on separate replicas)")  # fmt: skip


def _up(args: argparse.Namespace) -> int:
    from services import supervisor
    from services.client import ClientError, show_cache_example
    from services.common.config import model_dir_problem

    model = Path(args.model)
    problem = model_dir_problem(args.model)
    if problem:
        print(f"strata up: {problem}", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print(f"strata up: --replicas must be at least 1, got {args.replicas}", file=sys.stderr)
        return 2
    roles = ("prefill",) * args.prefill_replicas + ("decode",) * args.decode_replicas
    if roles and (args.prefill_replicas < 1 or args.decode_replicas < 1):
        print("strata up: --prefill-replicas and --decode-replicas go together, each at least 1", file=sys.stderr)
        return 2
    if roles and args.host_cache_bytes in ("0", 0):
        print("strata up: prefill/decode replicas hand the KV over through the kvstore: keep --host-cache-bytes",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.handoff_outbox_bytes and not roles:
        print("strata up: --handoff-outbox-bytes is for --prefill-replicas / --decode-replicas", file=sys.stderr)
        return 2
    replicas = len(roles) or args.replicas
    if args.worker_cpus and len(args.worker_cpus.split(";")) != replicas:
        print(f"strata up: --worker-cpus needs one CPU list per replica ({replicas}), separated by ';'",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.worker_threads:
        threads = args.worker_threads.split(";")
        if len(threads) != replicas or not all(t.strip().isdigit() for t in threads):
            print(f"strata up: --worker-threads needs one thread count (0: one per core) per replica ({replicas}), "
                  f"separated by ';', got {args.worker_threads!r}", file=sys.stderr)  # fmt: skip
            return 2
    if args.tp is not None and args.tp < 1:
        print(f"strata up: --tp must be at least 1, got {args.tp}", file=sys.stderr)
        return 2
    if args.speculative_algorithm == "draft" and not args.speculative_draft_model:
        print("strata up: --speculative-algorithm draft needs --speculative-draft-model DIR", file=sys.stderr)
        return 2
    if args.speculative_draft_model and (problem := model_dir_problem(args.speculative_draft_model)):
        print(f"strata up: --speculative-draft-model: {problem}", file=sys.stderr)
        return 2
    if args.speculative_algorithm == "mtp":
        from services.worker.models.qwen3_next_mtp import mtp_problem

        if args.speculative_draft_model:
            print("strata up: --speculative-algorithm mtp drafts with the model's own head; drop "
                  "--speculative-draft-model", file=sys.stderr)  # fmt: skip
            return 2
        if problem := mtp_problem(args.model):
            print(f"strata up: --speculative-algorithm mtp: {problem}", file=sys.stderr)
            return 2
    run_dir = Path(args.run_dir or f".runs/{time.strftime('%Y%m%d-%H%M%S')}")
    args.run_dir_path = str(run_dir)
    args.tls_files = None
    if args.tls:
        from services.common.tls import make_dev_certs

        hosts = ["localhost", "127.0.0.1", *([args.host] if args.host else [])]
        args.tls_files = make_dev_certs(run_dir / "tls", hosts)
        print(f"TLS on every hop: development CA and certificates in {run_dir / 'tls'} (clients trust ca.pem)")
    print(f"starting Strata for {model} (logs in {run_dir})")
    if note := _shared_cores_note(args, roles):
        print(note, file=sys.stderr)
    a = _stack_args(args)
    try:
        stack = supervisor.start_stack(
            model, args.port, run_dir, etcd=args.etcd, worker_args=a["worker"], scheduler_args=a["scheduler"],
            common_args=a["common"], tokenizer_args=a["tokenizer"], http_port=args.http_port,
            replicas=args.replicas, etcd_tls=args.tls_files, roles=roles,
            replica_worker_args=_replica_worker_args(args, roles),
        )
    except (supervisor.StartError, OSError) as e:
        print(f"strata up: {e}", file=sys.stderr)
        return 1
    address = stack.child("tokenizer").address
    extra = stack.child("tokenizer").extra
    scheme = "https" if "https" in extra else "http"
    http = extra.get(scheme)
    name = args.served_model_name or model.name
    if args.example:
        try:
            ca = args.tls_files.ca if args.tls_files else ""
            show_cache_example(address, args.example, key=(args.api_key or "").split(",")[0], out=sys.stdout, ca=ca)
        except ClientError as e:  # the stack keeps serving; the user sees why the example failed
            print(f"example request failed: {e}", file=sys.stderr)
    if http:
        print(
            f"\nOpenAI-compatible API at {scheme}://{http}/v1 (model {name!r}); for example\n"
            f"  curl {scheme}://{http}/v1/completions -H 'content-type: application/json' \\\n"
            f"       -d '{{\"model\": \"{name}\", \"prompt\": \"The cache\", \"max_tokens\": 16}}'"
        )
    print(f"\nStrata is serving strata.v1.Strata on {address}. Ctrl-C stops all services.", flush=True)
    return supervisor.supervise(stack, restart=args.restart)


def _serve(args: argparse.Namespace, rest: list[str]) -> int:
    if args.service == "tokenizer":  # as `python -m services.tokenizer`: a process without torch
        from services.tokenizer.torchless import hide_torch

        hide_torch()
    module = importlib.import_module(f"services.{args.service}.server")
    module.main(rest)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from services.client import generate
    from strata.v1 import strata_pb2 as pb

    sampling = pb.SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop=args.stop,
        top_k=args.top_k, min_p=args.min_p, ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
    )
    for name in ("top_p", "seed", "repetition_penalty"):
        if getattr(args, name) is not None:
            setattr(sampling, name, getattr(args, name))
    req = pb.GenerateRequest(sampling=sampling, cache_salt=args.cache_salt)
    if args.chat:
        req.messages.messages.add(role="user", content=args.text)
    else:
        req.text = args.text
    for kind in ("json_schema", "regex", "ebnf"):
        value = getattr(args, kind)
        if value:
            setattr(req, kind, Path(value[1:]).read_text() if value.startswith("@") else value)
    generate(args.address, req, key=args.api_key, out=sys.stdout, ca=args.tls_ca)
    return 0


def _cert(args: argparse.Namespace) -> int:
    from services.common.tls import make_dev_certs

    files = make_dev_certs(Path(args.out), args.host or ["localhost", "127.0.0.1"], args.days)
    print(f"wrote a development CA ({files.ca}) and a service certificate ({files.cert}, {files.key})\n"
          f"  services: --tls-cert {files.cert} --tls-key {files.key} --tls-ca {files.ca}\n"
          f"  clients:  trust {files.ca}")
    return 0


def _model(args: argparse.Namespace) -> int:
    from services.worker.tiny import write_tiny_checkpoint

    out = write_tiny_checkpoint(args.arch, args.size, Path(args.out), seed=args.seed)
    print(f"wrote {args.size} {args.arch} checkpoint to {out}")
    return 0


def _grpc(args: argparse.Namespace) -> int:
    from services.grpc_client import run_reflection_command

    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    return run_reflection_command(args.address, args.action, args.target, args.json, metadata=metadata)


def _bench(args: argparse.Namespace) -> int:
    from services.bench.cli import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata", description="Strata LLM inference server")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start etcd and all services on loopback")
    up.add_argument("--model", required=True, help="Hugging Face model directory")
    up.add_argument("--served-model-name", default="", help="name clients use (default: the directory name)")
    up.add_argument("--port", type=int, default=50051, help="public port of strata.v1.Strata (gRPC)")
    up.add_argument("--http-port", type=int, default=8000,
                    help="OpenAI-compatible HTTP port (0 = off, -1 = pick a free one)")
    up.add_argument("--host", default="", help="bind address of every service (default 127.0.0.1)")
    up.add_argument("--api-key", default="", help="API keys (comma-separated) required by /v1/* and gRPC")
    up.add_argument("--api-key-file", default="", help="a file of API keys, one per line")
    up.add_argument("--tls", action="store_true",
                    help="TLS on the public ports, mutual TLS between services; a development CA in "
                         "<run-dir>/tls (real certificates: strata serve ... --tls-cert/--tls-key/--tls-ca)")
    up.add_argument("--etcd", default="", help="use this etcd endpoint instead of starting one")
    up.add_argument("--restart", default="no", choices=["no", "on-failure"],
                    help="a service that crashes: stop everything (no), or start it again at the same "
                         "ports after a backoff of 1 s doubling to 30 s (on-failure); its requests resume. "
                         "The etcd it started (not --etcd) likewise, on its data directory")
    up.add_argument("--replicas", type=int, default=1,
                    help="worker + scheduler pairs behind the one tokenizer (each on --device)")
    up.add_argument("--prefill-replicas", type=int, default=0,
                    help="prefill/decode disaggregation: replicas that prefill new requests and hand them "
                         "over after one token through the kvstore (with --decode-replicas; replaces --replicas)")
    up.add_argument("--decode-replicas", type=int, default=0,
                    help="replicas that take the handed-over requests, load their pages and decode")
    up.add_argument("--handoff-outbox-bytes", default="",
                    help="hand the KV over directly: each prefill worker keeps its prompts' pages in an outbox "
                         "of this size (e.g. 1GiB) that the decode workers read from, instead of the kvstore")
    up.add_argument("--worker-cpus", default="",
                    help="each replica's worker on CPUs of its own: one list per replica, separated by ';' "
                         "(e.g. '0-7;8-15'; the worker's --cpus); default: not pinned")
    up.add_argument("--worker-threads", default="",
                    help="each replica's forward threads: one count per replica, separated by ';' (e.g. '0;1': "
                         "0 is one per core; the worker's --threads). Workers that share a CPU host's cores "
                         "without --worker-cpus each take every core; a decode worker on fewer threads keeps "
                         "its steps short beside a prefill worker's long ones")
    up.add_argument("--tool-call-parser", default="", choices=["", "hermes", "qwen3_coder"],
                    help="how the model writes tool calls (default hermes: Qwen3's <tool_call>{json}</tool_call>)")
    up.add_argument("--reasoning-parser", default="", choices=["", "none", "qwen3"],
                    help="qwen3: <think>...</think> becomes reasoning_content (default none)")
    up.add_argument("--router-policy", default="", choices=["", "kv", "round_robin", "least_load"],
                    help="how the tokenizer picks a replica (default kv: where the prompt is cached, weighed by load)")
    up.add_argument("--front-processes", type=int, default=None,
                    help="tokenizer processes serving the public ports (default 1; more where one front "
                         "process is the limit, ~20k streamed tokens/s)")
    up.add_argument("--tp", type=int, default=None,
                    help="tensor-parallel ranks per worker (the worker starts them; gloo on the CPU)")
    up.add_argument("--device", default="", help="worker device: cpu or cuda:N (default cpu)")
    up.add_argument("--dtype", default="", choices=["", "float32", "bfloat16", "float16"], help="weights and KV")
    up.add_argument("--page-size", type=int, default=None, help="tokens per KV page")
    up.add_argument("--context-length", type=int, default=None, help="tokens per request (default: the model's)")
    up.add_argument("--kv-cache-bytes", default="", help="KV pool size, e.g. 512MiB (default: from free memory)")
    up.add_argument("--kv-mem-fraction", type=float, default=None,
                    help="share of free memory for the KV pool when --kv-cache-bytes is unset (CPU 0.1, CUDA 0.8)")
    up.add_argument("--host-cache-bytes", default="256MiB",
                    help="host (L2) pool, with L3 on the kvstore; 0 = device cache only")
    up.add_argument("--max-running", type=int, default=None, help="requests decoded at once")
    up.add_argument("--max-prefill-tokens", "--chunked-prefill-size", dest="max_prefill_tokens", type=int,
                    default=None, help="prompt tokens per step: longer prompts are prefilled in chunks")
    up.add_argument("--max-waiting", type=int, default=None, help="queued requests before 429 / RESOURCE_EXHAUSTED")
    up.add_argument("--speculative-algorithm", default=None, choices=["ngram", "draft", "mtp"],
                    help="speculative decoding: ngram drafts from each request's own context, draft from "
                         "--speculative-draft-model, mtp from the checkpoint's own MTP head (Qwen3-Next; "
                         "default off)")
    up.add_argument("--speculative-draft-model", default="",
                    help="a smaller checkpoint with the model's tokenizer that drafts tokens (implies draft)")
    up.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                    help="draft tokens verified per step at most (default 4)")
    up.add_argument("--no-metrics", dest="metrics", action="store_false",
                    help="no Prometheus endpoints (default: one per service, listed at start)")
    up.add_argument("--trace-exporter", default="none", choices=["none", "console", "file", "otlp"],
                    help="spans (file: <run-dir>/spans-<service>.jsonl); OTEL_* variables apply when none")
    up.add_argument("--otlp-endpoint", default="", help="send spans to this OTLP/gRPC collector (host:port)")
    up.add_argument("--log-level", default="", help="debug, info, warning, error")
    up.add_argument("--run-dir", default="", help="where logs go (default .runs/<time>)")
    up.add_argument("--example", default=EXAMPLE,
                    help="prompt of the example request, sent twice to show the cache ('' = none)")

    serve = sub.add_parser("serve", help="run one service (flags: strata serve SERVICE --help)")
    serve.add_argument("service", choices=SERVICES)

    gen = sub.add_parser("generate", help="generate text through strata.v1.Strata")
    gen.add_argument("text")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY", ""),
                     help="sent as authorization: Bearer (default $STRATA_API_KEY)")
    gen.add_argument("--tls-ca", default="", help="connect with TLS, trusting this CA (PEM file)")
    gen.add_argument("--chat", action="store_true", help="send the text as a user chat message")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=None)
    gen.add_argument("--cache-salt", default="", help="share cached prefixes only with this salt")
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", default="", help="a JSON schema, or @FILE")
    constraint.add_argument("--regex", default="", help="output must match this regex")
    constraint.add_argument("--ebnf", default="", help="an EBNF grammar (root ::= ...), or @FILE")

    cert = sub.add_parser("cert", help="write a development CA and a certificate for the services")
    cert.add_argument("--out", default="tls", help="directory for ca.pem, ca.key, service.pem, service.key")
    cert.add_argument("--host", action="append", default=[], help="a host name or IP the certificate is for "
                      "(repeatable; default localhost and 127.0.0.1)")
    cert.add_argument("--days", type=int, default=365)

    model = sub.add_parser("model", help="model utilities")
    msub = model.add_subparsers(dest="model_command", required=True)
    tiny = msub.add_parser("tiny", help="write a random-weight checkpoint with a trained BPE tokenizer")
    tiny.add_argument("--arch", choices=["qwen3", "qwen3-next"], default="qwen3")
    tiny.add_argument("--size", choices=["tiny", "bench", "null", "0.6b", "0.6b-4"], default="tiny",
                      help="tiny: tests; bench: a few tens of millions of parameters; null: one thin layer; "
                      "0.6b: Qwen3-0.6B's shape and vocabulary (qwen3 only, ~3 GB); 0.6b-4: the same, 4 layers")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)

    from services.bench.cli import add_bench_parser  # light: no torch at import

    add_bench_parser(sub)

    g = sub.add_parser("grpc", help="reflection-based gRPC client (no grpcurl needed)")
    g.add_argument("action", choices=["list", "describe", "call"])
    g.add_argument("target", nargs="?", default="", help="service or Service/Method")
    g.add_argument("json", nargs="?", default="{}", help="request as JSON (call)")
    g.add_argument("--address", default="127.0.0.1:50051")
    g.add_argument("--api-key", default=os.environ.get("STRATA_API_KEY", ""),
                   help="sent as authorization: Bearer (default $STRATA_API_KEY)")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["serve"] and len(argv) >= 2 and argv[1] in SERVICES:
        # Everything after the service name belongs to the service's own parser.
        args = parser.parse_args(argv[:2])
        sys.exit(_serve(args, argv[2:]))
    args = parser.parse_args(argv)
    handlers = {"up": _up, "generate": _generate, "model": _model, "grpc": _grpc, "bench": _bench, "cert": _cert}
    from services.client import ClientError

    try:
        code = handlers[args.command](args)
    except (ClientError, OSError) as e:  # one clear line, never a traceback
        print(f"strata {args.command}: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
