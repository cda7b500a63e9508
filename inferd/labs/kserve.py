"""KServe: the fleet spec rendered as `inferd deploy k8s` writes `kserve.yaml` (into `<out>`, no cluster touched),
validated offline against KServe's CRD schemas, and its pods' memory against what such a replica takes here."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import httpx
import yaml

from inferd.bench.client import ttfts
from inferd.config import parse_memory
from inferd.errors import InferdError
from inferd.fleet.spec import FleetSpec, load_fleet
from inferd.labs.base import Explanation, Lab, Measurement, bars, fmt
from inferd.labs.context import LabContext, shown_path
from inferd.procs import rss_samples, start_serve
from inferd.runtime.disagg import scraped_samples

MIB = 2**20
EXAMPLE_FLEET = Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml"  # in a checkout
BREAKS = 3  # fields `validation` breaks in a copy of the LLMInferenceService


def read_fleet(ctx: LabContext):
    """(source, spec): --fleet, else the checkout's examples/fleet.yaml, else one pool of the run's model."""
    if path := ctx.fleet or (EXAMPLE_FLEET if EXAMPLE_FLEET.exists() else None):
        return shown_path(path), load_fleet(path)
    pool = {"name": "main", "replicas": 1, "resources": {"cpu": 1, "memory": "2Gi"}}
    model = {"name": "m", "model": ctx.model, "engine": {"max_num_seqs": 16}, "pools": [pool]}
    return "a one-pool fleet of the run's model", FleetSpec.model_validate({"models": [model]})


def render_kserve(spec) -> list[dict]:
    from inferd.deploy.k8s import K8sOptions, render

    if not (objs := render(spec, K8sOptions())["kserve.yaml"]):
        raise InferdError("the fleet has only disaggregated models, which KServe's manifests leave out")
    return objs


def validation(objs: list[dict]) -> tuple[list[dict], list[str]]:
    """Each object's kind, name, fields and errors against KServe's CRD schemas; and the errors of a copy of the
    LLMInferenceService with BREAKS fields broken the ways hands break YAML."""
    from inferd.deploy.validate import errors, report

    bad = copy.deepcopy(next(o for o in objs if o["kind"] == "LLMInferenceService"))
    bad["spec"]["replica"] = bad["spec"].pop("replicas", 1)  # a misspelt field
    bad["spec"]["model"]["uri"] = 42  # a wrong type
    container = bad["spec"]["template"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe", {})  # a misspelt field, deep in the pod
    return report(objs), [str(e) for e in errors(bad)]


def field_table(llm: dict) -> str:
    """The LLMInferenceService's fields that decide cost and latency, as a Markdown table: its replicas, the
    engine's flags (explained by their --help) and the pod's resources (`c` is its engine container)."""
    from inferd.cli import flag_help

    spec, c = llm["spec"], llm["spec"]["template"]["containers"][0]
    rows = [("spec.model.uri", spec["model"]["uri"], "where the weights come from")]
    rows.append(("spec.replicas", spec["replicas"], "engine pods, each with its own weights and KV pool"))
    helps, args = flag_help(c["args"][0]), [*c["args"][1:], "--"]  # args[0] is the subcommand
    for flag, value in zip(args, args[1:], strict=False):
        if flag.startswith("--"):
            rows.append((f"c.args {flag}", "(on)" if value.startswith("--") else value, helps.get(flag) or "-"))
    does = {"requests": "reserved for the pod", "limits": "the most the pod may use (memory: else OOM-killed)"}
    rows += [(f"c.resources.{kind}.{k}", v, does[kind]) for kind, r in c["resources"].items() for k, v in r.items()]
    head = ["| field | value rendered | what it does |", "|---|---|---|"]
    return "\n".join(head + [f"| `{f}` | `{v}` | {d} |" for f, v, d in rows])


def measure(ctx: LabContext) -> Measurement:
    source, spec = read_fleet(ctx)
    objs = render_kserve(spec)
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "kserve.yaml").write_text(yaml.safe_dump_all(objs, sort_keys=False))
    checked, caught = validation(objs)
    llm = next(o for o in objs if o["kind"] == "LLMInferenceService")
    model, pool = next((m, p) for m in spec.models for p in m.pools if f"inferd-{p.name}" == llm["metadata"]["name"])
    flags = [*model.engine_flags(pool), "--device", ctx.device]
    flags += ["--attention-backend", "torch"] if ctx.quick else []  # no native-kernel build in a quick run
    seqs = model.engine_config(pool).scheduler.max_num_seqs
    with ctx.procs.scoped():  # a replica as the pod runs it (the run's model): idle, then at its peak under a burst
        proc = ctx.procs.started(start_serve(ctx.model, ctx.workdir, "m", *flags))
        ctx.procs.wait(proc)
        with httpx.Client(timeout=10) as http:
            info = scraped_samples(http, proc.url, "inferd:cache_config_info")[0].labels
            max_len = http.get(proc.url + "/v1/models").json()["data"][0]["max_model_len"]
        prompt_len = min(ctx.size(128, 512), max_len - 16)
        with rss_samples(proc.popen.pid) as seen:
            ttfts(proc.url, [[16 + (i * 31 + k * 7) % 480 for k in range(prompt_len)] for i in range(seqs)], seqs)
    facts, host = ctx.facts, float(str(ctx.torch_device).startswith("cpu"))  # on a GPU: in device memory
    pool_tokens, per_token = int(info["num_gpu_blocks"]) * int(info["block_size"]), facts.kv_bytes_per_token
    limit = llm["spec"]["template"]["containers"][0]["resources"]["limits"]["memory"]
    n = dict(objects=len(objs), fields_validated=sum(o["fields"] for o in checked), broken_edits=BREAKS)
    n |= dict(validation_errors=sum(len(o["errors"]) for o in checked), broken_errors=len(caught))
    n |= dict(max_num_seqs=seqs, max_model_len=max_len, kv_bytes_per_token=per_token, kv_pool_tokens=pool_tokens)
    n |= dict(full_tokens=seqs * max_len, full_seqs_fit=pool_tokens // max_len)
    n |= dict(rss_idle_mib=seen[0] / MIB, rss_peak_mib=max(seen) / MIB, limit_mib=parse_memory(limit) / MIB)
    weights = facts.resident_params * facts.elem_bytes  # the embedding included
    n |= dict(host_kv_mib=host * pool_tokens * per_token / MIB, host_weights_mib=host * weights / MIB)
    n["runtime_mib"] = max(0.0, n["rss_peak_mib"] - n["host_kv_mib"] - n["host_weights_mib"])
    n["suggested_mib"] = 256 * math.ceil(1.25 * n["rss_peak_mib"] / 256)  # a quarter over the peak
    settings = dict(fleet=source, fleet_model=model.model, measured_model=ctx.model_label, pool=pool.name)
    settings |= dict(out_yaml=shown_path(ctx.out / "kserve.yaml"), prompt_len=prompt_len)
    return Measurement(n, {"objects": checked, "caught": caught, "fields": field_table(llm)}, settings)


def explain(m: Measurement) -> Explanation:
    s = m.settings
    kinds = ", ".join(f"{o['kind']} {o['name']} ({o['fields']} fields)" for o in m.series["objects"])
    claims = [
        m.must(
            "validation_errors <= 0",
            yes="The {objects} objects validate against KServe's CRD schemas, unknown fields rejected: "
            "{fields_validated} fields checked, {validation_errors} errors.",
            no="KServe's CRD schemas found {validation_errors} errors in the {fields_validated} fields rendered.",
        ),
        m.must(
            "broken_errors >= broken_edits",
            yes="The check is not a formality: the LLMInferenceService with {broken_edits} fields broken (a misspelt "
            "`replica`, a number for `model.uri`, a misspelt `readinesProbe`) drew {broken_errors} errors.",
            no="A manifest with {broken_edits} broken fields drew only {broken_errors} errors.",
        ),
        m.either(
            "limit_mib >= rss_peak_mib",
            yes="The pod's memory limit ({limit_mib} MiB) covers a replica's peak under {max_num_seqs} requests at "
            "once, {rss_peak_mib} MiB ({rss_idle_mib} MiB idle: the KV pool is reserved at start).",
            no="The pod's memory limit ({limit_mib} MiB) is below a replica's measured peak of {rss_peak_mib} MiB: "
            "Kubernetes would OOM-kill it under load. Raise resources.memory to about {suggested_mib} MiB.",
        ),
        m.either(
            "kv_pool_tokens >= full_tokens",
            yes="At {kv_bytes_per_token} bytes of KV per token the pool holds {kv_pool_tokens} tokens: all "
            "{max_num_seqs} sequences at the full {max_model_len} tokens ({full_tokens} tokens).",
            no="At {kv_bytes_per_token} bytes of KV per token the pool holds {kv_pool_tokens} tokens: {full_seqs_fit} "
            "sequences at the full {max_model_len} tokens, not all {max_num_seqs} ({full_tokens}): the rest wait.",
        ),
    ]
    intro = f"The fleet spec ({s['fleet']}) rendered as `inferd deploy k8s` writes kserve.yaml: {kinds}, checked "
    intro += f"against KServe's CRD schemas (inferd/deploy/crds) and written to {s['out_yaml']}. Memory was measured "
    intro += f"on `inferd serve` with pool {s['pool']}'s flags, serving {s['measured_model']} (the spec names "
    intro += f"{s['fleet_model']}). The fields that decide cost and latency:\n\n" + m.series["fields"]
    why = "Why it matters: on Kubernetes a model is a resource to declare (on a cluster, KServe's controller would "
    why += "build the engine Deployment, an HTTPRoute and llm-d's scheduler from these objects; none was touched), "
    why += f"and its memory request must hold weights, KV pool and runtime ({fmt(m.numbers['runtime_mib'])} MiB here)."
    return Explanation([intro], claims, [why])


def plot(m: Measurement, fig) -> None:
    n = m.numbers
    parts = {"weights": n["host_weights_mib"], "KV pool": n["host_kv_mib"], "runtime": n["runtime_mib"]}
    parts |= {"idle RSS": n["rss_idle_mib"], "peak RSS": n["rss_peak_mib"], "pod limit": n["limit_mib"]}
    ax = bars(fig, parts, ylabel="MiB", title="Memory: what the manifest asks, what a replica takes")
    ax.axhline(n["suggested_mib"], color="k", ls=":", label=f"1.25 x peak ({fmt(n['suggested_mib'])} MiB)")
    ax.legend()


LAB = Lab("kserve", "KServe", measure, explain, plot, timed=False)  # sizes and counts, not times
