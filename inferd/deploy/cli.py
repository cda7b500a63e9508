"""`inferd deploy k8s|ray --config fleet.yaml`: render the fleet for Kubernetes or Ray Serve.

`observability` writes a Grafana dashboard and SLO burn-rate alert rules.
`ray` writes Serve's config file (`serve run` / `serve deploy`) for the app in `inferd.runtime.ray`.
`k8s` writes one YAML file per group of objects and a `kustomization.yaml` into `--out` (or prints
the base set to stdout); `kubectl apply -k DIR` deploys it. The spec is validated first: a broken one
gets an error naming the file, line and field, and nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("deploy", help="render a fleet spec for Kubernetes or Ray Serve")
    sub = p.add_subparsers(dest="target", required=True)
    k = sub.add_parser("k8s", help="Kubernetes manifests: engines, gateway, KEDA, KServe, Inference Extension")
    k.add_argument("--config", required=True, help="the fleet spec (the YAML `inferd up` reads)")
    k.add_argument("--out", default=None, help="folder for the YAML files and kustomization.yaml (default: stdout)")
    k.add_argument("--autoscale", action="store_true", help="KEDA ScaledObjects from each pool's autoscaling")
    k.add_argument("--gpu", action="store_true", help="request nvidia.com/gpu and use the CUDA image")
    k.add_argument("--namespace", default="inferd")
    k.add_argument("--image", default="ghcr.io/inferd/inferd:0.1.0", help="the inferd image (see Dockerfile)")
    k.add_argument("--prometheus-url", default="http://prometheus-operated.monitoring.svc:9090")
    k.add_argument("--startup-timeout", type=int, default=1200, help="seconds a replica may take to load")
    k.add_argument("--model-cache-pvc", default=None, help="PersistentVolumeClaim for the model cache")
    k.add_argument("--inference-gateway", default="inference-gateway", help="Gateway for the HTTPRoute")
    k.add_argument("--gateway-replicas", type=int, default=None)
    k.set_defaults(func=run_k8s)
    r = sub.add_parser("ray", help="a Ray Serve config (serve deploy / serve run) for the fleet")
    r.add_argument("--config", required=True, help="the fleet spec (the YAML `inferd up` reads)")
    r.add_argument("--out", default=None, help="where to write serve_config.yaml (default: stdout)")
    r.add_argument("--host", default="0.0.0.0")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--metrics-names", choices=["inferd", "vllm"], default="vllm", help="the replicas' /metrics names")
    r.set_defaults(func=run_ray)
    o = sub.add_parser("observability", help="a Grafana dashboard and Prometheus SLO burn-rate alert rules")
    o.add_argument("--out", required=True, help="folder for inferd-dashboard.json and inferd-alerts.yaml")
    o.add_argument("--ttft-slo", type=float, default=1.0, help="seconds to first token (a histogram bucket bound)")
    o.add_argument("--itl-slo", type=float, default=0.1, help="seconds between tokens (a histogram bucket bound)")
    o.add_argument("--slo-objective", type=float, default=0.99, help="share of requests within the SLO")
    o.set_defaults(func=run_observability)


def run_k8s(args: argparse.Namespace) -> int:
    import yaml

    from inferd.deploy.k8s import K8sOptions, kustomization, render
    from inferd.fleet.spec import load_fleet

    spec = load_fleet(args.config)
    opts = K8sOptions(
        namespace=args.namespace,
        image=args.image,
        gpu=args.gpu,
        autoscale=args.autoscale,
        prometheus_url=args.prometheus_url,
        startup_timeout_s=args.startup_timeout,
        model_cache_pvc=args.model_cache_pvc,
        inference_gateway=args.inference_gateway,
        gateway_replicas=args.gateway_replicas,
    )
    files = render(spec, opts)
    if args.out is None:
        base = [o for name, objs in files.items() if name in kustomization(files, opts)["resources"] for o in objs]
        sys.stdout.write(yaml.safe_dump_all(base, sort_keys=False))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, objs in files.items():
        (out / name).write_text(yaml.safe_dump_all(objs, sort_keys=False))
    (out / "kustomization.yaml").write_text(yaml.safe_dump(kustomization(files, opts), sort_keys=False))
    print(f"wrote {len(files) + 1} files to {out}: kubectl apply -k {out}")
    return 0


def run_ray(args: argparse.Namespace) -> int:
    import yaml

    from inferd.deploy.ray import RayOptions, serve_config
    from inferd.fleet.spec import load_fleet

    spec = load_fleet(args.config)
    text = yaml.safe_dump(
        serve_config(spec, RayOptions(metrics_names=args.metrics_names, host=args.host, port=args.port)),
        sort_keys=False,
    )
    if args.out is None:
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_config.yaml").write_text(text)
    path = out / "serve_config.yaml"
    print(f"wrote {path}: `serve run {path}` (local), `serve deploy {path}` (a running Ray cluster)")
    return 0


def run_observability(args: argparse.Namespace) -> int:
    import json

    import yaml

    from inferd.deploy.observability import SLO, alert_rules, dashboard

    slo = SLO(ttft_s=args.ttft_slo, itl_s=args.itl_slo, objective=args.slo_objective)
    rules = alert_rules(slo)  # checks the SLO first
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "inferd-dashboard.json").write_text(json.dumps(dashboard(slo), indent=2) + "\n")
    (out / "inferd-alerts.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    print(f"wrote {out}/inferd-dashboard.json (import into Grafana) and {out}/inferd-alerts.yaml (rule_files)")
    return 0
