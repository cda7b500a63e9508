"""The OpenAI API through the official client against a real server with a tiny model."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def sse_events(url: str, body: dict) -> list[str]:
    """The raw `data:` payloads of a streamed response, in order."""
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line.removeprefix("data: ") for line in r.iter_lines() if line]


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME, "tiny-alias"]
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["dtype"] == "float32"  # the tests pin it
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_completion(server, client):
    r = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.model == MODEL_NAME
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == len(server.engine.tokenizer.encode(PROMPT))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    # the alias serves the same model, and token-id prompts are the same prompt
    ids = server.engine.tokenizer.encode(PROMPT)
    again = client.completions.create(
        model="tiny-alias", prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].text == choice.text


def test_completion_stream_matches_non_stream(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)  # no usage unless asked for


def test_batch_prompts_and_echo(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt=["Hello", "Paged attention"], n=2, max_tokens=4, temperature=0, echo=True
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("Hello") and r.choices[2].text.startswith("Paged attention")
    assert r.choices[0].text == r.choices[1].text  # greedy: both of n agree


def test_chat(server, client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    prompt = server.engine.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(server.engine.tokenizer.encode(prompt, add_special_tokens=False))
    # max_completion_tokens is the newer spelling of max_tokens
    r2 = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r2.usage.completion_tokens == 3 and r2.choices[0].finish_reason == "length"


def test_chat_stream_wire_format(server, client):
    body = {
        "model": MODEL_NAME,
        "messages": CHAT,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = sse_events(server.url + "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-2]
    assert content and all(set(c["choices"][0]["delta"]) == {"content"} for c in content)
    final = chunks[-2]["choices"][0]
    assert final["delta"] == {} and final["finish_reason"] == "length"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    non_stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert text == non_stream.choices[0].message.content


def test_n_and_seed(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=7)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # each of n gets its own seed
    assert 3 <= a.usage.completion_tokens <= 24
    chunks = list(
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, n=2, max_tokens=4, stream=True, seed=1)
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[1].choices[0].delta.role == "assistant"
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_stop_strings(client):
    base = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**base).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip("\ufffd")
    r = client.completions.create(stop=[stop, "never-there"], **base).choices[0]
    assert r.finish_reason == "stop" and r.stop_reason == stop
    assert r.text == full[: full.index(stop)]
    streamed = list(client.completions.create(stop=stop, stream=True, **base))
    assert "".join(c.choices[0].text for c in streamed) == r.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert top[token] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the sampled token is the most likely
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = list(
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, stream=True)
    )
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_vllm_extras_are_used(client):
    base = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=10)
    greedy = client.completions.create(temperature=0, extra_body={"ignore_eos": True}, **base).choices[0].text
    top_k_1 = client.completions.create(temperature=1.0, seed=3, extra_body={"top_k": 1, "ignore_eos": True}, **base)
    assert top_k_1.choices[0].text == greedy  # top_k=1 leaves only the greedy token
    min_p_1 = client.completions.create(temperature=1.0, seed=3, extra_body={"min_p": 1.0, "ignore_eos": True}, **base)
    assert min_p_1.choices[0].text == greedy
    # a strong repetition penalty must change a long greedy run (the tiny model repeats itself within 48 tokens)
    long = dict(base, max_tokens=48)
    plain = client.completions.create(temperature=0, extra_body={"ignore_eos": True}, **long).choices[0].text
    penalised = (
        client.completions.create(temperature=0, extra_body={"repetition_penalty": 5.0, "ignore_eos": True}, **long)
        .choices[0]
        .text
    )
    assert penalised != plain
    r = client.completions.create(temperature=0, extra_body={"min_tokens": 10, "ignore_eos": True}, **base)
    assert r.usage.completion_tokens == 10


def test_stop_token_ids(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"stop_token_ids": list(range(384))}
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.stop_reason, int)
    assert r.usage.completion_tokens == 1


def test_concurrent_streams_equal_sequential(server, client):
    prompts = [f"Request {i}: " + PROMPT * (1 + i % 3) for i in range(16)]
    body = dict(model=MODEL_NAME, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    sequential = [client.completions.create(prompt=p, **body).choices[0].text for p in prompts]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(prompt=prompt, stream=True, **body)
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(all_at_once()) == sequential
    server.wait_idle()


def test_tokenize_detokenize(server):
    tok = server.engine.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    d = httpx.post(server.url + "/detokenize", json={"tokens": tok.encode(PROMPT, add_special_tokens=False)}).json()
    assert d["prompt"] == PROMPT
