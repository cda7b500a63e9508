"""The Dockerfile, without a container builder (none runs on the CI machine): non-root, the model cache as a
volume, a health check, CPU and CUDA from build args, and the command and paths the manifests assume."""

from __future__ import annotations

import json
import re
from pathlib import Path

from inferd.cli import build_parser
from inferd.deploy import pods

DOCKERFILE = Path(__file__).parents[2] / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())  # join continued lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_image_runs_as_the_manifests_expect():
    ins = _instructions()
    kinds = [k for k, _ in ins]
    assert kinds.count("FROM") == 1 and ins[kinds.index("FROM")][1] == "${BASE}"
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    assert args["BASE"].startswith("python:3.11") and args["TORCH_INDEX"].endswith("/cpu")
    (user,) = [a for k, a in ins if k == "USER"]
    assert user == f"{pods.UID}:{pods.UID}"  # the uid the pods' securityContext names
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN")  # nothing runs as root after
    (volume,) = [a for k, a in ins if k == "VOLUME"]
    assert json.loads(volume) == [pods.CACHE_DIR]
    env = " ".join(a for k, a in ins if k == "ENV")
    assert f"HF_HOME={pods.CACHE_DIR}/huggingface" in env and f"TORCH_EXTENSIONS_DIR={pods.CACHE_DIR}" in env
    (health,) = [a for k, a in ins if k == "HEALTHCHECK"]
    assert "/health" in env and "INFERD_HEALTH_URL" in health and "--start-period" in health
    entry = json.loads(next(a for k, a in ins if k == "ENTRYPOINT"))
    cmd = json.loads(next(a for k, a in ins if k == "CMD"))
    assert entry == ["inferd"]  # what the manifests' `command` is
    args = build_parser().parse_args(cmd)
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == pods.ENGINE_PORT
