"""Deployment targets rendered from one fleet spec: Kubernetes manifests (plain, KEDA, KServe, Gateway API
Inference Extension) and a Ray Serve application. See docs/deploy.md."""
