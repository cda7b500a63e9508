"""The Grafana dashboard and the SLO alert rules: every metric they query is one a live server (and, for
tenants and routing, a live gateway) really exports, every expression parses (promtool), and an SLO
threshold that is not a histogram bucket is refused."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess

import httpx
import pytest
import yaml

from inferd.cli import main
from inferd.deploy.observability import ITL_BUCKETS, SLO, TTFT_BUCKETS, alert_rules, dashboard, expressions
from inferd.errors import ConfigError
from tests.gateway.procs import start_gateway
from tests.server.conftest import MODEL_NAME, start_server

KEY = "tenant-key"
METRIC = re.compile(r"\b(?:inferd:[a-zA-Z0-9_:]+|inferd_gateway_[a-zA-Z0-9_]+|gen_ai_[a-zA-Z0-9_]+)")


def _without_labels(expr: str) -> str:
    """The expression less its label matchers and grouping clauses, so only metric names are left."""
    expr = re.sub(r"\{[^}]*\}", "", expr)
    return re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", "", expr)


def _names(text: str) -> set[str]:
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture(scope="module")
def exported(tiny_models, tmp_path_factory):
    """Sample names of a server's and a gateway's /metrics after traffic of every kind."""
    srv = start_server(tiny_models["llama"])
    log_dir = tmp_path_factory.mktemp("obs")
    config = {
        "pools": [{"name": "p", "replicas": [srv.url]}],
        "models": [{"name": MODEL_NAME, "backends": [{"pool": "p"}]}],
        "tenants": [{"id": "team-a", "api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]}],
    }
    gw, _ = start_gateway(config, log_dir)
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        prompt = "one two three four five six seven eight nine ten " * 4  # some full prefix blocks
        for stream in (False, True):
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "stream": stream}
            r = httpx.post(gw.url + "/v1/completions", json=body, headers=auth, timeout=60)
            assert r.status_code == 200, r.text
        server_text = httpx.get(srv.url + "/metrics", timeout=10).text
        gateway_text = httpx.get(gw.url + "/metrics", timeout=10).text
    finally:
        gw.stop()
        srv.stop()
    return server_text, _names(server_text) | _names(gateway_text)


def test_every_metric_the_dashboard_and_the_rules_use_is_exported(exported):
    server_text, names = exported
    exprs = expressions(dashboard(), alert_rules(SLO()))
    used = {m for e in exprs for m in METRIC.findall(_without_labels(e))}
    assert len(used) >= 15, used
    assert used <= names, sorted(used - names)
    for panel in ("Time to first token", "KV cache usage", "Prefix cache hit rate", "Preemptions", "Tokens per tenant"):
        assert panel in {p["title"] for p in dashboard()["panels"]}
    # the SLO thresholds count from real buckets
    assert 'inferd:time_to_first_token_seconds_bucket{le="1.0"' in server_text
    assert 'inferd:inter_token_latency_seconds_bucket{le="0.1"' in server_text


def test_the_bucket_lists_are_the_servers():
    from inferd.server import metrics

    assert metrics.TTFT_BUCKETS == TTFT_BUCKETS and metrics.ITL_BUCKETS == ITL_BUCKETS


def test_every_expression_parses_and_the_rules_file_is_valid(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool (Debian's prometheus package) is needed"
    main(["deploy", "observability", "--out", str(tmp_path), "--ttft-slo", "0.5", "--itl-slo", "0.05"])
    rules_path = tmp_path / "inferd-alerts.yaml"
    r = subprocess.run([promtool, "check", "rules", str(rules_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    dash = json.loads((tmp_path / "inferd-dashboard.json").read_text())
    record = [
        {"record": f"inferd:panel_{i}", "expr": e.replace("$__rate_interval", "1m").replace("$model_name", ".*")}
        for i, e in enumerate(t["expr"] for p in dash["panels"] for t in p["targets"])
    ]
    (tmp_path / "panels.yaml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": record}]}))
    r = subprocess.run([promtool, "check", "rules", str(tmp_path / "panels.yaml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rules = yaml.safe_load(rules_path.read_text())["groups"][0]["rules"]
    ttft = next(x for x in rules if x["alert"] == "InferdTTFTSLOBurnPage")
    assert 'le="0.5"' in ttft["expr"] and "> 0.144" in ttft["expr"] and "[5m]" in ttft["expr"]


def test_an_slo_between_buckets_is_refused_with_the_nearest():
    with pytest.raises(ConfigError, match=r"--ttft-slo 0.3s is not a histogram bucket bound.*nearest: 0.25"):
        alert_rules(SLO(ttft_s=0.3))
    with pytest.raises(ConfigError, match="slo-objective"):
        alert_rules(SLO(objective=1.0))
