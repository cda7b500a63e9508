"""KServe: the reader's fleet spec rendered the way `inferd deploy k8s` writes `kserve.yaml` (an
`LLMInferenceService` per model, plus a `ServingRuntime` and an `InferenceService` per model for KServe's
classic API), validated offline against KServe's CRD schemas (`inferd.deploy.validate`, unknown fields
rejected), each field of the LLMInferenceService explained, and the memory its pods ask for set against what
a replica of the model really takes here: weights, the KV pool the engine reserves up front, and the
runtime, read from a running `inferd serve` started with the pool's own flags.

No cluster is touched: the lab writes `<out>/kserve.yaml` and says what `kubectl apply` would do with it.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from inferd.errors import InferdError
from inferd.labs.base import Explanation, Lab, Measurement, fmt
from inferd.labs.context import LabContext, shown_path
from inferd.procs import complete

DEFINITION = (
    "Kubernetes-native model serving: a custom resource (InferenceService, and LLMInferenceService for LLMs) "
    "declares the model, its runtime, replicas and routing, and KServe's controller builds the pods, the route "
    "and the scaling from it."
)
MIB = 2**20
EXAMPLE_FLEET = Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml"  # in a checkout

# the glossary term each `inferd serve` flag in the pod's args belongs to (what it does is its --help)
TERMS = {
    "--max-num-seqs": "continuous batching",
    "--kv-cache-memory": "KV cache",
    "--num-blocks": "PagedAttention",
    "--block-size": "PagedAttention",
    "--max-model-len": "KV cache",
    "--max-num-batched-tokens": "ITL / TPOT",
    "--enable-prefix-caching": "SGLang",
    "--no-enable-prefix-caching": "SGLang",
    "--dtype": "GPU economics",
    "--quantization": "GPU economics",
    "--num-threads": "GPU economics",
    "--attention-backend": "TensorRT-LLM",
    "--metrics-names": "vLLM",
    "--drain-timeout": "continuous batching",
    "--model": "KServe",
    "--served-model-name": "vLLM",
}


# -- the fleet, rendered and validated ----------------------------------------------------------------------
def read_fleet(ctx: LabContext):
    """The fleet spec the lab renders: --fleet, else the checkout's examples/fleet.yaml, else one pool of the
    run's model. Returns (where it came from, spec)."""
    from inferd.fleet.spec import FleetSpec, load_fleet

    path = ctx.fleet or (EXAMPLE_FLEET if EXAMPLE_FLEET.exists() else None)
    if path is not None:
        return shown_path(path), load_fleet(path)
    pool = {"name": "main", "replicas": 1, "resources": {"cpu": 1, "memory": "2Gi"}}
    return "a one-pool fleet of the run's model", FleetSpec.model_validate(
        {"models": [{"name": "m", "model": ctx.model, "engine": {"max_num_seqs": 16}, "pools": [pool]}]}
    )


def render_kserve(spec) -> list[dict]:
    from inferd.deploy.k8s import K8sOptions, render

    objs = render(spec, K8sOptions())["kserve.yaml"]
    if not objs:
        raise InferdError("the fleet has only disaggregated models, which KServe's manifests leave out")
    return objs


def broken_copy(llm: dict) -> tuple[dict, int]:
    """The LLMInferenceService with fields broken the ways hands break YAML; (the copy, how many breaks)."""
    bad = copy.deepcopy(llm)
    bad["spec"]["replica"] = bad["spec"].pop("replicas", 1)  # a misspelt field
    bad["spec"]["model"]["uri"] = 42  # a wrong type
    container = bad["spec"]["template"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe", {})  # a misspelt field, deep in the pod
    return bad, 3


@dataclass
class Checked:
    """Each object against KServe's CRD schemas (kind, name, fields, errors), and the broken copy's errors."""

    per_object: list[dict[str, Any]]
    breaks: int
    caught: list[str]

    @property
    def fields(self) -> int:
        return sum(o["fields"] for o in self.per_object)

    @property
    def errors(self) -> int:
        return sum(len(o["errors"]) for o in self.per_object)


def validation(objs: list[dict]) -> Checked:
    from inferd.deploy.validate import body, errors, leaf_fields

    per_object = [
        {"kind": o["kind"], "name": o["metadata"]["name"], "fields": len(leaf_fields(body(o))), "errors": errors(o)}
        for o in objs
    ]
    bad, breaks = broken_copy(next(o for o in objs if o["kind"] == "LLMInferenceService"))
    return Checked(per_object, breaks, [str(e) for e in errors(bad)])


# -- the field table ------------------------------------------------------------------------------------------
def _arg_rows(args: list[str]) -> list[tuple[str, str, str, str]]:
    from inferd.cli import flag_help

    helps = flag_help(args[0])  # args[0] is the subcommand (serve)
    rows = []
    i = 1
    while i < len(args):
        flag = args[i]
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
        does = helps.get(flag) or f"an `inferd {args[0]}` flag"
        rows.append((f"c.args {flag}", value or "(on)", does, TERMS.get(flag, "-")))
        i += 2 if value else 1
    return rows


def field_rows(llm: dict) -> list[tuple[str, str, str, str]]:
    """(field, value rendered, what it does, glossary term) for the LLMInferenceService's fields."""
    spec = llm["spec"]
    pod = spec["template"]
    c = pod["containers"][0]
    res = c["resources"]
    start = c["startupProbe"]
    rows = [
        ("apiVersion, kind", f"{llm['apiVersion']} {llm['kind']}", "KServe's LLM API (llm-d underneath)", "KServe"),
        ("spec.model.uri", spec["model"]["uri"], "where the weights come from", "KServe"),
        ("spec.model.name", spec["model"]["name"], "the name clients send as `model`", "vLLM"),
    ]
    if "storageInitializer" in spec:
        rows.append(
            ("spec.storageInitializer.enabled", str(spec["storageInitializer"]["enabled"]).lower(),
             "no download step: the image carries this model", "KServe")
        )  # fmt: skip
    rows += [
        ("spec.replicas", str(spec["replicas"]), "engine pods, each with its own weights and KV pool", "throughput"),
        ("spec.router.gateway", "{}", "attach to the cluster's inference Gateway", "KServe"),
        ("spec.router.route", "{}", "KServe creates the HTTPRoute to this model", "KServe"),
        ("spec.router.scheduler", "{}", "KServe deploys llm-d's scheduler: pods picked by queue, KV use, prefix",
         "NVIDIA Dynamo"),
        ("c.image", c["image"], "inferd's image (`inferd serve`)", "-"),
    ]  # fmt: skip
    rows += _arg_rows(c["args"])
    rows += [
        ("c.resources.requests.cpu", str(res["requests"]["cpu"]), "cores reserved; no CPU limit (throttling a "
         "decode loop costs latency)", "GPU economics"),
        ("c.resources.requests.memory", str(res["requests"]["memory"]), "memory reserved: weights + KV pool + "
         "runtime (measured below)", "KV cache"),
        ("c.resources.limits.memory", str(res["limits"]["memory"]), "past this the pod is OOM-killed", "KV cache"),
    ]  # fmt: skip
    if "nvidia.com/gpu" in res["requests"]:
        rows.append(("c.resources.requests[nvidia.com/gpu]", str(res["requests"]["nvidia.com/gpu"]), "GPUs per pod",
                     "GPU economics"))  # fmt: skip
    rows += [
        ("c.startupProbe", f"/health, {start['periodSeconds'] * start['failureThreshold']} s",
         "time to load the model before the pod is restarted", "inference-aware autoscaling"),
        ("c.readinessProbe", f"/health every {c['readinessProbe']['periodSeconds']} s",
         "a draining or sick pod leaves the route", "-"),
        ("spec.template.terminationGracePeriodSeconds", str(pod["terminationGracePeriodSeconds"]),
         "longer than the drain: the running batch finishes", "continuous batching"),
        ("spec.template.securityContext", "non-root, read-only root", "the pod's hardening", "-"),
        ("spec.template.volumes[0]", "emptyDir" if "emptyDir" in pod["volumes"][0] else "PVC",
         "Hugging Face downloads and compiled kernels", "-"),
    ]  # fmt: skip
    return rows


def table(rows: list[tuple[str, str, str, str]]) -> str:
    lines = ["| field | value rendered | what it does | glossary |", "|---|---|---|---|"]
    lines += [f"| `{f}` | `{v}` | {d} | {t} |" for f, v, d, t in rows]
    return "\n".join(lines)


# -- what a replica takes ---------------------------------------------------------------------------------
def replica_flags(ctx: LabContext, spec, model, pool) -> list[str]:
    """The pool's `inferd serve` flags, less the model (the run's model is measured) and its name."""
    argv = spec.serve_argv(model, pool)
    out, i = [], 0
    while i < len(argv):
        if argv[i] in ("--model", "--served-model-name"):
            i += 2
            continue
        out.append(argv[i])
        i += 1
    out += ["--device", ctx.device]
    if ctx.quick:
        out += ["--attention-backend", "torch"]  # no native-kernel build in a quick run
    return out


@dataclass
class Replica:
    """An `inferd serve` with the pool's flags, as it reported itself and as it held memory: idle, then at its
    peak under a burst of `max_num_seqs` concurrent requests."""

    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    prompt_len: int
    rss_idle: float
    rss_peak: float
    burst_errors: int


def engine_sizes(url: str) -> dict[str, int]:
    """What the replica's engine allocated and allows: its KV blocks and their size (`cache_config_info`,
    vLLM's info gauge), and its max_model_len (`/v1/models`)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text)
    info = next(f for f in families if f.name.endswith("cache_config_info")).samples[0].labels
    (card,) = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return {"num_blocks": int(info["num_gpu_blocks"]), "block_size": int(info["block_size"]),
            "max_model_len": int(card["max_model_len"])}  # fmt: skip


def replica_memory(ctx: LabContext, flags: list[str], seqs: int) -> Replica:
    from inferd.procs import rss_samples, start_serve

    with ctx.scoped():
        proc = ctx.started(start_serve(ctx.model, ctx.workdir, "m", *flags))
        ctx.wait(proc)
        sizes = engine_sizes(proc.url)
        prompt_len = min(ctx.size(128, 512), sizes["max_model_len"] - 16)
        with rss_samples(proc.popen.pid) as seen, ThreadPoolExecutor(seqs) as pool:
            codes = list(pool.map(lambda i: _complete(proc.url, i, prompt_len, 16), range(seqs)))
    errors = sum(c != 200 for c in codes)
    return Replica(**sizes, max_num_seqs=seqs, prompt_len=prompt_len, rss_idle=seen[0], rss_peak=max(seen),
                   burst_errors=errors)  # fmt: skip


def _complete(url: str, i: int, prompt_len: int, out_len: int) -> int:
    prompt = [16 + (i * 31 + k * 7) % 480 for k in range(prompt_len)]
    return complete(url, prompt, out_len, timeout=600).status_code


# -- the lab ------------------------------------------------------------------------------------------------
def measure(ctx: LabContext) -> Measurement:
    import yaml

    from inferd.config import parse_memory

    source, spec = read_fleet(ctx)
    objs = render_kserve(spec)
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "kserve.yaml").write_text(yaml.safe_dump_all(objs, sort_keys=False))
    checked = validation(objs)
    llm = next(o for o in objs if o["kind"] == "LLMInferenceService")
    model, pool = next((m, p) for m in spec.models for p in m.pools if f"inferd-{p.name}" == llm["metadata"]["name"])
    facts = ctx.facts()
    per_token = facts.kv_bytes_per_token
    r = replica_memory(ctx, replica_flags(ctx, spec, model, pool), model.engine_config(pool).scheduler.max_num_seqs)
    pool_bytes = r.num_blocks * r.block_size * per_token
    pool_tokens = r.num_blocks * r.block_size
    on_host = str(ctx.torch_device).startswith("cpu")  # on a GPU, weights and KV live in device memory
    weights = facts.resident_params * facts.elem_bytes
    resources = llm["spec"]["template"]["containers"][0]["resources"]
    seqs, max_len, burst_tokens = r.max_num_seqs, r.max_model_len, r.max_num_seqs * (r.prompt_len + 16)
    n: dict[str, float] = {
        "objects": len(objs),
        "models": sum(1 for o in objs if o["kind"] == "LLMInferenceService"),
        "fields_validated": checked.fields,
        "validation_errors": checked.errors,
        "broken_edits": checked.breaks,
        "broken_errors": len(checked.caught),
        "replicas": llm["spec"]["replicas"],
        "max_num_seqs": seqs,
        "max_model_len": max_len,
        "block_size": r.block_size,
        "kv_bytes_per_token": per_token,
        "kv_pool_mib": pool_bytes / MIB,
        "kv_pool_tokens": pool_tokens,
        "full_tokens": seqs * max_len,
        "kv_full_mib": seqs * max_len * per_token / MIB,
        "full_seqs_fit": pool_tokens // max_len,
        "weights_mib": weights / MIB,
        "burst_seqs": seqs,
        "burst_tokens": burst_tokens,
        "burst_kv_mib": burst_tokens * per_token / MIB,
        "burst_errors": r.burst_errors,
        "rss_idle_mib": r.rss_idle / MIB,
        "rss_peak_mib": r.rss_peak / MIB,
        "host_kv_mib": pool_bytes / MIB if on_host else 0.0,
        "host_weights_mib": weights / MIB if on_host else 0.0,
        "request_mib": parse_memory(resources["requests"]["memory"]) / MIB,
        "limit_mib": parse_memory(resources["limits"]["memory"]) / MIB,
    }
    n["runtime_mib"] = max(0.0, n["rss_peak_mib"] - n["host_kv_mib"] - n["host_weights_mib"])
    n["spare_mib"] = n["limit_mib"] - n["rss_peak_mib"]
    n["suggested_mib"] = 256 * math.ceil(1.25 * n["rss_peak_mib"] / 256)
    settings = {
        "fleet": source,
        "fleet_model": model.model,
        "measured_model": ctx.model_label,
        "pool": pool.name,
        "out_yaml": shown_path(ctx.out / "kserve.yaml"),
        "cluster": _cluster(),
        "prompt_len": r.prompt_len,
    }
    series = {
        "objects": [{k: v for k, v in o.items() if k != "errors"} | {"errors": len(o["errors"])} for o in
                    checked.per_object],
        "caught": checked.caught,
        "fields": field_rows(llm),
    }  # fmt: skip
    return Measurement(numbers=n, series=series, settings=settings)


def _cluster() -> str:
    """Whether kubectl and a kubeconfig are here (the lab never uses them)."""
    kubectl = shutil.which("kubectl")
    config = Path((os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")).split(os.pathsep)[0])
    if kubectl and config.exists():
        return f"kubectl and a kubeconfig ({config}) are here, but the lab does not apply anything"
    return "no cluster is configured on this machine" + ("" if kubectl else " (and no kubectl)")


def explain(m: Measurement) -> Explanation:
    n, s = m.numbers, m.settings
    kinds = ", ".join(f"{o['kind']} {o['name']} ({o['fields']} fields)" for o in m.series["objects"])
    claims = [
        m.decide(
            "validation_errors <= 0",
            must=True,
            yes="The {objects} objects validate against KServe's CRD schemas with unknown fields rejected: "
            "{fields_validated} fields checked, {validation_errors} errors.",
            no="The rendered objects broke KServe's CRD schemas: {validation_errors} errors in {fields_validated} "
            "fields.",
        ),
        m.decide(
            "broken_errors >= broken_edits",
            must=True,
            yes="The check is not a formality: the same LLMInferenceService with {broken_edits} fields broken (a "
            "misspelt `replica`, a number for `model.uri`, a misspelt `readinesProbe`) drew {broken_errors} errors.",
            no="A manifest with {broken_edits} broken fields drew only {broken_errors} errors.",
        ),
        m.decide(
            "limit_mib >= rss_peak_mib",
            textbook=False,
            yes="The pod's memory limit ({limit_mib} MiB, from resources.memory) covers a replica's measured peak of "
            "{rss_peak_mib} MiB with {spare_mib} MiB to spare.",
            no="The pod's memory limit ({limit_mib} MiB) is below a replica's measured peak of {rss_peak_mib} MiB: "
            "Kubernetes would OOM-kill it under load. Raise resources.memory to about {suggested_mib} MiB.",
        ),
        m.decide(
            "rss_idle_mib >= host_kv_mib",
            textbook=False,
            yes="An idle replica already held {rss_idle_mib} MiB, the {host_kv_mib} MiB KV pool included: the engine "
            "reserves the pool at start, so the request must cover it before the first request arrives; "
            "{burst_seqs} requests at once ({burst_tokens} tokens, {burst_kv_mib} MiB of KV) raised it to "
            "{rss_peak_mib} MiB.",
            no="An idle replica held {rss_idle_mib} MiB, less than its {host_kv_mib} MiB KV pool: the pool's pages "
            "were not all touched yet.",
        ),
        m.decide(
            "kv_pool_mib >= weights_mib",
            yes="The KV pool ({kv_pool_mib} MiB) outweighs the weights ({weights_mib} MiB), as the glossary says: "
            "the KV cache, not the model, sets how much a replica can serve at once.",
            no="Here the weights ({weights_mib} MiB) outweigh the KV pool ({kv_pool_mib} MiB): this spec gives the "
            "cache less memory than the model, so concurrency, not memory for weights, is what it rations.",
        ),
        m.decide(
            "kv_pool_tokens >= full_tokens",
            textbook=False,
            yes="At {kv_bytes_per_token} bytes of KV per token, the pool holds {kv_pool_tokens} tokens: all "
            "{max_num_seqs} sequences at the full {max_model_len} tokens ({full_tokens} tokens, {kv_full_mib} MiB).",
            no="At {kv_bytes_per_token} bytes of KV per token, the pool holds {kv_pool_tokens} tokens: "
            "{full_seqs_fit} sequences at the full {max_model_len} tokens, not all {max_num_seqs} (that would be "
            "{full_tokens} tokens, {kv_full_mib} MiB). Paged blocks let the batch fill with shorter sequences; "
            "past the pool the scheduler queues or preempts.",
        ),
    ]
    intro = [
        f"This lab rendered the fleet spec ({s['fleet']}) the way `inferd deploy k8s` writes kserve.yaml: "
        f"{kinds}. It validated them offline against KServe's CRD schemas (shipped in inferd/deploy/crds) and "
        f"wrote them to {s['out_yaml']}. The memory numbers come from `inferd serve` started with pool "
        f"{s['pool']}'s flags on this machine, serving {s['measured_model']} (the spec names {s['fleet_model']}).",
        "The LLMInferenceService, field by field (`c` is spec.template.containers[0], the engine):\n\n"
        + table([tuple(r) for r in m.series["fields"]]),
    ]
    why = [
        f"No cluster was used: {s['cluster']}. On a cluster with KServe's CRDs and controller, `kubectl apply -f "
        f"{Path(s['out_yaml']).name}` would store the objects (the API server checks them against the same "
        "schemas); KServe's controller would then create the engine Deployment from the pod template, an "
        "HTTPRoute on the inference Gateway and llm-d's scheduler (an InferencePool with its endpoint picker), "
        "and, for the InferenceService, a predictor from the `inferd` ServingRuntime. Without KServe installed, "
        "kubectl stops at the first object: no matches for kind LLMInferenceService.",
        "Why it matters: on Kubernetes a model is a resource to declare, not a server to babysit. The fields "
        "that decide cost and latency are the ones above: replicas, the batch and KV settings, and the memory "
        f"request, which must hold the weights, the whole KV pool and the runtime with its activations "
        f"({fmt(n['runtime_mib'])} MiB here at the peak) from the moment the pod starts.",
    ]
    return Explanation(intro, claims, why)


def plot(m: Measurement, fig) -> None:
    a, b = fig.subplots(1, 2, width_ratios=[3, 2])
    n = m.numbers
    parts = [("weights", n["host_weights_mib"]), ("KV pool", n["host_kv_mib"])]
    parts.append(("runtime + activations", n["runtime_mib"]))
    bottom = 0.0
    for i, (label, v) in enumerate(parts):
        a.bar(["replica, measured peak"], [v], bottom=bottom, label=label, color=f"C{i}")
        bottom += v
    a.bar(["replica, idle"], [n["rss_idle_mib"]], color="C7", label="idle RSS")
    a.bar(["pod limit (manifest)"], [n["limit_mib"]], color="C4", label="resources.memory")
    a.axhline(n["suggested_mib"], color="k", ls=":", label=f"1.25 x peak ({fmt(n['suggested_mib'])} MiB)")
    a.set(ylabel="MiB", title="Memory: what the manifest asks, what a replica takes")
    a.legend(fontsize=8)
    objs = m.series["objects"]
    b.barh([o["kind"] for o in objs], [o["fields"] for o in objs], color="C2", label="fields validated")
    b.barh(["LLMInferenceService,\nfields broken"], [n["broken_errors"]], color="C3", label="errors caught")
    for i, o in enumerate(objs):
        b.text(o["fields"], i, f" {o['errors']} errors", va="center", fontsize=8)
    b.text(n["broken_errors"], len(objs), f" {fmt(n['broken_errors'])} errors", va="center", fontsize=8)
    b.set(xlabel="fields (green), errors (red)", title="Against KServe's CRD schemas")
    b.margins(x=0.2)


LAB = Lab("kserve", "KServe", DEFINITION, measure, explain, plot, timed=False)  # sizes and counts, not times
