"""LoRA adapters over the OpenAI API, as vLLM serves them: `model` names the adapter, /v1/models lists adapters
with their parent, /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time (behind the API
key), unknown adapters get 404 `model_not_found`, bad ones 400, and /metrics says which adapters run."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import VOCAB
from tests.engine.hf_reference import prompt_set
from tests.engine.lora_adapters import make_adapter, peft_greedy
from tests.server.conftest import MODEL_NAME, start_server

KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = prompt_set(VOCAB, lengths=(9,))[0]


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("api-adapters")
    folder = tiny_models["llama"]
    return {
        "sql": make_adapter(folder, root / "sql", seed=11),
        "chat": make_adapter(folder, root / "chat", ("q_proj", "v_proj", "down_proj"), r=8, seed=12),
    }


@pytest.fixture(scope="module")
def lora_server(tiny_models, adapters):
    srv = start_server(
        tiny_models["llama"], api_key=KEY, lora_modules=[f"sql={adapters['sql']}"], max_loras=2, max_lora_rank=8,
        settings={"metrics_names": "vllm"},
    )  # fmt: skip
    yield srv
    srv.stop()


def _complete(srv, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=60)


def _post(srv, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def test_a_request_names_its_adapter_by_model(lora_server, tiny_models, adapters):
    r = _complete(lora_server, "sql")
    assert r.status_code == 200, r.text
    want = lora_server.engine.tokenizer.decode(peft_greedy(tiny_models["llama"], adapters["sql"], PROMPT, 6))
    assert r.json()["choices"][0]["text"] == want
    assert r.json()["model"] == "sql"
    base = _complete(lora_server, MODEL_NAME)
    assert base.status_code == 200 and base.json()["choices"][0]["text"] != want
    # the official client, streaming, chat
    client = OpenAI(base_url=lora_server.url + "/v1", api_key=KEY)
    chunks = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True, temperature=0
    )
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    lora_server.wait_idle()


def test_models_lists_adapters_with_their_parent(lora_server):
    data = httpx.get(lora_server.url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    cards = {m["id"]: m for m in data}
    assert cards["sql"]["parent"] == MODEL_NAME and cards["sql"]["root"] == "sql"  # a folder's name, not its path
    assert cards[MODEL_NAME]["parent"] is None
    assert httpx.get(lora_server.url + "/v1/models/sql", headers=AUTH, timeout=10).json()["parent"] == MODEL_NAME


def test_unknown_adapter_is_model_not_found(lora_server):
    r = _complete(lora_server, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(lora_server.url + "/v1/models/nope", headers=AUTH, timeout=10).status_code == 404


def test_load_and_unload_at_run_time(lora_server, tiny_models, adapters, tmp_path):
    assert _complete(lora_server, "chat").status_code == 404
    # behind the API key
    assert _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "x"}, {}).status_code == 401
    r = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(adapters["chat"])})
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    r = _complete(lora_server, "chat")
    want = peft_greedy(tiny_models["llama"], adapters["chat"], PROMPT, 6)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == lora_server.engine.tokenizer.decode(want)
    # loading the same name again needs load_inplace
    again = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(adapters["sql"])})
    assert again.status_code == 400 and again.json()["error"]["code"] == "adapter_exists"
    # bad adapters: 400 with the reason, nothing changed
    bad = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, "is not a folder"),
        ({"lora_name": "x", "lora_path": str(tiny_models["llama"])}, "has no adapter_config.json"),
        ({"lora_name": MODEL_NAME, "lora_path": str(adapters["sql"])}, "base model's name"),
        ({"lora_name": "", "lora_path": "x"}, "lora_name"),
    ]
    for body, message in bad:
        r = _post(lora_server, "/v1/load_lora_adapter", body)
        assert r.status_code == 400 and message in r.json()["error"]["message"] + str(r.json()["error"]["param"])
    assert lora_server.state.adapter("x") is None
    r = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert r.status_code == 200 and "removed" in r.text
    assert _complete(lora_server, "chat").status_code == 404
    r = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    lora_server.wait_idle()


def test_metrics_say_which_adapters_run(lora_server):
    assert _complete(lora_server, "sql").status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(lora_server.url + "/metrics").text)}
    (info,) = families["vllm:lora_requests_info"].samples
    assert info.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "2"}
    tokens = {s.labels["lora_name"]: s.value for s in families["inferd:lora_generation_tokens"].samples}
    assert tokens["sql"] >= 6
    assert families["inferd:lora_loads"].samples[0].value >= 1


def test_a_server_without_lora_refuses_to_load(server):
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}, timeout=10)
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_bench_spreads_requests_over_adapters(lora_server, tmp_path):
    """`inferd bench serve --lora-modules` asks for each adapter in turn: the server counts each one's tokens."""
    from inferd.cli import main

    def generated() -> dict[str, float]:
        families = text_string_to_metric_families(httpx.get(lora_server.url + "/metrics").text)
        fam = next(f for f in families if f.name == "inferd:lora_generation_tokens")
        return {s.labels["lora_name"]: s.value for s in fam.samples}

    before = generated()
    argv = ["bench", "serve", "--base-url", lora_server.url, "--model", MODEL_NAME, "--lora-modules", "sql",
            MODEL_NAME, "--api-key", KEY, "--num-prompts", "6", "--num-warmups", "0", "--random-input-len", "16",
            "--random-output-len", "4", "--ignore-eos", "--no-progress", "--result-dir", str(tmp_path),
            "--result-filename", "r.json", "--save-result"]  # fmt: skip
    assert main(argv) == 0
    assert generated()["sql"] - before.get("sql", 0) == 3 * 4  # every other request, 4 tokens each
    lora_server.wait_idle()
