"""lm-evaluation-harness against Strata: its ``local-completions`` model (Strata's
``/v1/completions`` with ``echo`` + ``logprobs``, the prompt scored in the forward that prefills it)
and its ``hf`` backend on the same checkpoint must compute the same loglikelihoods.

The task is ``benchmarks/lm_eval/strata_tiny.yaml`` (multiple choice over a committed jsonl: nothing
is downloaded; the tokenizer is the checkpoint's own). Every (question, choice) loglikelihood of the
two runs is compared, and so are the greedy flags and the task's metrics.

    python -m benchmarks.lm_eval_compare --model models/qwen3-tiny [--base-url http://host:8000] [--out F]

Without ``--base-url`` a stack is started for the run (``strata up``'s supervisor, loopback). Needs
the ``eval`` extra (``pip install -e '.[eval]'``; ``make eval`` installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "benchmarks" / "lm_eval"
TASK = "strata_tiny"
TOLERANCE = 1e-4  # |Δ loglikelihood| allowed per (question, choice): fp32 on both sides
METRICS = ("acc,none", "acc_norm,none")


@dataclass(frozen=True, slots=True)
class Comparison:
    """The two backends' figures on the task and how far apart they are."""

    docs: int
    requests: int  # loglikelihood requests per backend (docs x choices)
    strata: dict[str, float]  # the task's metrics
    hf: dict[str, float]
    max_abs_delta: float  # the largest |Δ loglikelihood| over every request
    greedy_equal: bool  # every request's is_greedy flag agrees
    strata_s: float  # wall seconds of each run
    hf_s: float
    tolerance: float = TOLERANCE

    @property
    def equal(self) -> bool:
        return self.max_abs_delta <= self.tolerance and self.greedy_equal and self.strata == self.hf


def _evaluate(model: str, model_args: str, batch_size: int) -> tuple[dict[str, float], list[tuple[float, bool]], float]:
    """One lm-eval run of the task: its metrics and every request's (loglikelihood, is_greedy), in
    document then choice order, and the wall seconds it took."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    out = simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK], batch_size=batch_size, log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False), bootstrap_iters=0,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    assert out is not None
    metrics = {k: float(out["results"][TASK][k]) for k in METRICS}
    scores = [
        (float(ll), bool(greedy))
        for sample in sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
        for ((ll, greedy),) in sample["resps"]
    ]
    return metrics, scores, seconds


def compare(model_dir: Path, base_url: str, served_name: str, api_key: str = "") -> Comparison:
    """Run the task with ``local-completions`` against ``base_url`` (serving ``model_dir`` as
    ``served_name``) and with the ``hf`` backend on ``model_dir``; the run's cwd must be the
    repository root (the task's data path is relative to it)."""
    if api_key:
        os.environ["OPENAI_API_KEY"] = api_key  # what lm-eval's API models send as a bearer token
    url = base_url.rstrip("/") + "/v1/completions"
    strata_args = (f"model={served_name},base_url={url},tokenizer_backend=huggingface,tokenizer={model_dir},"
                   "num_concurrent=4,max_retries=1,timeout=120")  # fmt: skip
    strata, strata_scores, strata_s = _evaluate("local-completions", strata_args, 1)
    hf, hf_scores, hf_s = _evaluate("hf", f"pretrained={model_dir},dtype=float32,device=cpu", 8)
    if len(strata_scores) != len(hf_scores):
        raise AssertionError(f"{len(strata_scores)} requests from Strata, {len(hf_scores)} from hf")
    deltas = [abs(a - b) for (a, _), (b, _) in zip(strata_scores, hf_scores, strict=True)]
    return Comparison(
        docs=sum(1 for _ in (TASKS / f"{TASK}.jsonl").open()),
        requests=len(hf_scores),
        strata=strata,
        hf=hf,
        max_abs_delta=max(deltas),
        greedy_equal=[g for _, g in strata_scores] == [g for _, g in hf_scores],
        strata_s=strata_s,
        hf_s=hf_s,
    )


def run(model_dir: Path, base_url: str = "", served_name: str = "") -> Comparison:
    """``compare``, against ``base_url`` or a stack started for the run (and stopped after it)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task's data is local: never reach a hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = model_dir.resolve()
    here = Path.cwd()
    with ExitStack() as stack:
        if not base_url:
            from services.common.etcd_proc import free_port
            from services.supervisor import start_stack

            run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="strata-lm-eval-")))
            up = start_stack(model_dir, free_port(), run_dir, http_port=free_port(), say=lambda _: None)
            stack.callback(up.stop)
            base_url = f"http://{up.child('tokenizer').extra['http']}"
        os.chdir(REPO)
        try:
            return compare(model_dir, base_url, served_name or model_dir.name)
        finally:
            os.chdir(here)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "models" / "qwen3-tiny", help="the checkpoint (HF directory)")
    ap.add_argument("--base-url", default="", help="a running Strata HTTP front (default: start a stack)")
    ap.add_argument("--model-name", default="", help="the name Strata serves it under (default: the directory's)")
    ap.add_argument("--out", type=Path, help="write the comparison here (JSON)")
    args = ap.parse_args(argv)
    result = run(args.model, args.base_url, args.model_name)
    row = "| {:<28} | {:>8} | {:>8} |"
    print(row.format("", "Strata", "hf"))
    for k in METRICS:
        print(row.format(k.split(",")[0], f"{result.strata[k]:.4f}", f"{result.hf[k]:.4f}"))
    print(row.format("seconds", f"{result.strata_s:.1f}", f"{result.hf_s:.1f}"))
    print(f"{result.requests} loglikelihoods over {result.docs} questions: max |Δ| = {result.max_abs_delta:.2e} "
          f"(tolerance {TOLERANCE:g}), greedy flags {'equal' if result.greedy_equal else 'DIFFER'}")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({**asdict(result), "equal": result.equal}, indent=2) + "\n")
    return 0 if result.equal else 1


if __name__ == "__main__":
    sys.exit(main())
