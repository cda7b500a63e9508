"""LoRA adapters: token-exact against transformers + peft, mixed batches, slots and eviction, the prefix cache
keyed per adapter, every weight mode, and the errors a bad adapter gets."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.config import ConfigError, make_engine_config
from inferd.errors import InvalidRequestError, ModelNotFoundError
from inferd.models.lora import LoRAError
from tests.conftest import VOCAB, assert_idle
from tests.engine.hf_reference import prompt_set
from tests.engine.lora_adapters import make_adapter, peft_greedy

NEW = 12
PROMPTS = prompt_set(VOCAB)[:5]  # 3 to 40 tokens: past the tiny Gemma 3's sliding window too
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """Per architecture: `all` adapts every layer kind; `attn` only q/v (rank 8, rsLoRA); `mlp` only the MLP."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for arch, folder in tiny_models.items():
        out[arch] = {
            "all": make_adapter(folder, root / arch / "all", seed=1),
            "attn": make_adapter(folder, root / arch / "attn", ("q_proj", "v_proj"), r=8, alpha=16, seed=2,
                                 use_rslora=True),
            "mlp": make_adapter(folder, root / arch / "mlp", ("gate_proj", "up_proj", "down_proj"), seed=3),
        }  # fmt: skip
    return out


def _llm(folder, adapters: dict, **settings) -> LLM:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return LLM(
        str(folder),
        max_model_len=256,
        dtype="float32",
        num_blocks=256,
        enable_lora=True,
        lora_modules=modules,
        **settings,
    )


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_adapters_match_transformers_and_peft(tiny_model, adapters):
    """Each adapter alone, and all three with the base model in one batch, give peft's tokens (unmerged and
    merged), and each adapter changes the model's output."""
    arch, mine = tiny_model.name, adapters[tiny_model.name]
    llm = _llm(tiny_model, mine)
    base = _tokens(llm.generate(PROMPTS, GREEDY))
    for name, path in mine.items():
        ref = [peft_greedy(tiny_model, path, p, NEW) for p in PROMPTS]
        got = _tokens(llm.generate(PROMPTS, GREEDY, lora_name=name))
        assert got == ref, f"{arch}/{name}"
        assert got != base, f"{arch}/{name}: the adapter changes nothing, so this test could not fail"
        if name == "all":
            assert got == [peft_greedy(tiny_model, path, p, NEW, merged=True) for p in PROMPTS], f"{arch} merged"
    # every request in one batch, interleaved: each gets the tokens it gets alone
    names = [None, "all", "attn", "mlp"]
    batch = [(p, names[i % 4]) for i, p in enumerate(PROMPTS * 4)]
    mixed = _tokens(llm.generate([p for p, _ in batch], GREEDY, lora_name=[n for _, n in batch]))
    alone = {n: _tokens(llm.generate(PROMPTS, GREEDY, lora_name=n)) for n in names}
    for i, ((_, name), got) in enumerate(zip(batch, mixed, strict=True)):
        assert got == alone[name][i % len(PROMPTS)], f"{arch}: row {i} under {name}"
    assert_idle(llm)


def test_one_slot_serves_adapters_in_turn(tiny_models, adapters):
    """max_loras=1: requests for two adapters in one call never share a step; the second waits for the slot
    (it is not failed), each adapter is loaded again when its turn comes, and the tokens are peft's."""
    folder, mine = tiny_models["llama"], adapters["llama"]
    llm = _llm(folder, mine, max_loras=1)
    names = ["all", "mlp", "all", None, "mlp"]
    outs = llm.generate(PROMPTS, GREEDY, lora_name=names)
    for p, name, got in zip(PROMPTS, names, _tokens(outs), strict=True):
        want = peft_greedy(folder, mine[name], p, NEW) if name else _tokens(llm.generate([p], GREEDY))[0]
        assert got == want, name
    stats = llm.engine.lora.stats
    assert stats.loads >= 2 and stats.evictions >= 1
    assert stats.generation_tokens == {"all": 2 * NEW, "mlp": 2 * NEW}
    assert_idle(llm)


def test_prefix_cache_is_keyed_per_adapter(tiny_models, adapters):
    folder, mine = tiny_models["llama"], adapters["llama"]
    llm = _llm(folder, mine)
    prompt = prompt_set(VOCAB, lengths=(70,))[0]

    def cached(name) -> int:
        (out,) = llm.generate([prompt], GREEDY, lora_name=name)
        return out.metrics.num_cached_tokens

    assert cached("all") == 0
    assert cached("all") == 64  # the same adapter reuses its blocks
    assert cached(None) == 0  # the base model does not reuse the adapter's
    assert cached("mlp") == 0
    assert cached(None) == 64
    assert_idle(llm)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_adapters_on_quantized_weights(tiny_models, adapters, quantization):
    """On int8 and int4 base weights the adapter's product is added to the quantized layer's output: the LoRA
    layer computes exactly base(x) + x A^T B^T s, and a mixed batch still gives each request its own tokens."""
    folder, mine = tiny_models["llama"], adapters["llama"]
    llm = _llm(folder, {"all": mine["all"]}, quantization=quantization)
    layer = llm.engine.lora.layers.layers["model.layers.0.self_attn.qkv_proj"]
    assert type(layer.base).__name__ == ("Int8Linear" if quantization == "int8" else "Int4Linear")
    alone = _tokens(llm.generate(PROMPTS, GREEDY, lora_name="all"))
    base = _tokens(llm.generate(PROMPTS, GREEDY))
    assert alone != base
    mixed = _tokens(llm.generate(PROMPTS * 2, GREEDY, lora_name=["all"] * 5 + [None] * 5))
    assert mixed == alone + base
    # the layer's arithmetic, slot 0 against the adapter's own tensors
    from safetensors.torch import load_file

    weights = load_file(mine["all"] / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.{}.lora_{}.weight"
    x = torch.randn(3, layer.in_features)
    lora = llm.engine.lora
    lora.activate(["all", None, "all"])
    try:
        y = layer(x)
    finally:
        lora.deactivate()
    base_y = layer.base(x)
    for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
        a, b = weights[key.format(name, "A")], weights[key.format(name, "B")]
        cols = slice(layer.offsets[part], layer.offsets[part] + layer.out_sizes[part])
        want = base_y[:, cols] + x @ a.T @ b.T * 2.0  # alpha 8 / r 4
        torch.testing.assert_close(y[0::2, cols], want[0::2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y[1], base_y[1], rtol=0, atol=0)  # the base model's row: exactly the base layer
    assert_idle(llm)


def test_speculative_decoding_under_an_adapter(tiny_models, adapters):
    """Drafts verified under an adapter keep exactly its greedy tokens (every row of a verifying request runs
    under its adapter)."""
    folder, mine = tiny_models["llama"], adapters["llama"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [(p * 4)[:60] for p in PROMPTS[1:4]]
    plain = _tokens(_llm(folder, mine).generate(prompts, params, lora_name="all"))
    spec = _llm(folder, mine, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_min": 1, "draft_policy": "all"})  # fmt: skip
    for one, want in zip(prompts, plain, strict=True):
        assert _tokens(spec.generate([one], params, lora_name="all")) == [want]
    assert spec.engine.spec_stats.num_drafts > 0
    assert_idle(spec)


def test_adapters_at_run_time(tiny_models, adapters, tmp_path):
    folder, mine = tiny_models["llama"], adapters["llama"]
    llm = LLM(str(folder), max_model_len=256, dtype="float32", num_blocks=256, enable_lora=True)
    engine = llm.engine
    with pytest.raises(ModelNotFoundError, match="no LoRA adapter named 'all'"):
        llm.generate(PROMPTS[:1], GREEDY, lora_name="all")
    engine.add_lora("all", str(mine["all"]))
    first = _tokens(llm.generate(PROMPTS, GREEDY, lora_name="all"))
    assert first == [peft_greedy(folder, mine["all"], p, NEW) for p in PROMPTS]
    # new weights under the same name replace the resident copy (and its cached blocks)
    engine.add_lora("all", str(mine["mlp"]))
    assert _tokens(llm.generate(PROMPTS, GREEDY, lora_name="all")) == [
        peft_greedy(folder, mine["mlp"], p, NEW) for p in PROMPTS
    ]
    # an adapter with running requests is neither unloaded nor replaced
    engine.add_request("r", PROMPTS[0], GREEDY, lora_name="all")
    with pytest.raises(InvalidRequestError, match="serves running requests"):
        engine.remove_lora("all")
    with pytest.raises(InvalidRequestError, match="serves running requests"):
        engine.add_lora("all", str(mine["attn"]))
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("all")
    with pytest.raises(ModelNotFoundError):
        engine.remove_lora("all")
    with pytest.raises(ModelNotFoundError):
        llm.generate(PROMPTS[:1], GREEDY, lora_name="all")
    assert not engine.lora.resident
    assert_idle(llm)


def test_no_lora_engine_refuses_adapters(tiny_models):
    llm = LLM(str(tiny_models["llama"]), max_model_len=256, dtype="float32", num_blocks=64)
    assert llm.engine.lora is None
    with pytest.raises(ModelNotFoundError, match="serves none"):
        llm.generate(PROMPTS[:1], GREEDY, lora_name="x")
    with pytest.raises(ConfigError, match="--enable-lora"):
        llm.engine.add_lora("x", "/nowhere")
    assert_idle(llm)


# -- bad adapters: each a LoRAError (a 400 from the API, a start error from --lora-modules) -------------------
def _broken(src, dst, config=None, drop=None):
    shutil.copytree(src, dst)
    if config is not None:
        path = dst / "adapter_config.json"
        path.write_text(config(path.read_text()))
    if drop:
        (dst / drop).unlink()
    return dst


def _edit(**changes):
    return lambda text: json.dumps({**json.loads(text), **changes})


BAD = {
    "missing folder": (lambda src, dst: dst / "nowhere", "is not a folder"),
    "no config": (lambda src, dst: _broken(src, dst, drop="adapter_config.json"), "has no adapter_config.json"),
    "config not JSON": (lambda src, dst: _broken(src, dst, lambda t: t[:20]), "is not JSON"),
    "no weights": (lambda src, dst: _broken(src, dst, drop="adapter_model.safetensors"), "has no adapter_model"),
    "rank too high": (lambda src, dst: _broken(src, dst, _edit(r=64)), "above --max-lora-rank 16"),
    "dora": (lambda src, dst: _broken(src, dst, _edit(use_dora=True)), "uses DoRA"),
    "prefix tuning": (lambda src, dst: _broken(src, dst, _edit(peft_type="PREFIX_TUNING")), "serves LORA"),
    "unknown target": (lambda src, dst: _broken(src, dst, _edit(target_modules=["c_attn"])), "adapts only"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapters_are_refused(tiny_models, adapters, tmp_path, case):
    make, message = BAD[case]
    path = make(adapters["llama"]["all"], tmp_path / "a")
    llm = _llm(tiny_models["llama"], {})
    with pytest.raises(LoRAError, match=message):
        llm.engine.add_lora("a", str(path))
    assert "a" not in llm.engine.lora.adapters
    with pytest.raises(LoRAError, match=message):
        _llm(tiny_models["llama"], {"a": path})


def test_an_adapter_name_with_a_comma_is_refused(tiny_models, adapters):
    llm = _llm(tiny_models["llama"], {})
    with pytest.raises(LoRAError, match="comma"):
        llm.engine.add_lora("a,b", str(adapters["llama"]["all"]))


def test_adapter_for_another_base_model_is_refused(tiny_models, adapters):
    """Qwen3's heads are 32 wide, Llama's 16: the shapes say the adapter was made for another base model."""
    llm = _llm(tiny_models["llama"], {})
    with pytest.raises(LoRAError, match=r"has A \[4, 64\] and B \[64, 4\], but .* takes 64 inputs to 32 .*trained on"):
        llm.engine.add_lora("q", str(adapters["qwen3"]["all"]))


def test_lora_settings():
    config = make_engine_config("m", lora_modules=["a=/x", '{"name": "b", "path": "/y"}'], max_loras=2)
    assert config.lora.enabled and config.lora.modules() == [("a", "/x"), ("b", "/y")]
    for bad, message in [(["a"], "name=path"), (["a=/x", "a=/y"], "twice"), (['{"name": 1}'], "name=path")]:
        with pytest.raises(ConfigError, match=message):
            make_engine_config("m", lora_modules=bad).validate()
    from inferd.config import engine_argv, engine_config_from_argv

    argv = engine_argv({"lora_modules": ("a=/x", "b=/y"), "max_lora_rank": 8})
    assert argv == ["--lora-modules", "a=/x", "b=/y", "--max-lora-rank", "8"]
    assert engine_config_from_argv(argv).lora.lora_modules == ("a=/x", "b=/y")


def test_preempted_requests_resume_under_their_adapter(tiny_models, adapters):
    """A cache too small for the batch preempts requests; they are recomputed under their own adapter."""
    folder, mine = tiny_models["llama"], adapters["llama"]
    prompts = prompt_set(VOCAB, lengths=(40, 57, 80, 31, 66, 50))
    names = ["all", "mlp", None, "attn", "all", "mlp"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(folder), max_model_len=256, dtype="float32", num_blocks=20, block_size=16, lora_modules=[
        f"{n}={p}" for n, p in mine.items()])  # fmt: skip
    got = _tokens(llm.generate(prompts, params, lora_name=names))
    assert llm.engine.scheduler.num_preemptions > 0, "the cache must be small enough to preempt"
    roomy = _llm(folder, mine)
    for p, name, tokens in zip(prompts, names, got, strict=True):
        assert tokens == _tokens(roomy.generate([p], params, lora_name=name))[0], name
    assert_idle(llm)


def test_host_memory_keeps_recent_adapters_between_slot_loads(tiny_models, adapters):
    """One slot, two adapters in turn: every turn is a slot load, but with room for both in host memory only
    the first load of each reads its file; with room for one, every load does."""
    folder, mine = tiny_models["llama"], adapters["llama"]
    names = ["all", "mlp", "all", "mlp", "all"]
    reads = {}
    for cpu in (2, 1):
        llm = _llm(folder, mine, max_loras=1, max_cpu_loras=cpu)
        got = [_tokens(llm.generate(PROMPTS[:1], GREEDY, lora_name=n))[0] for n in names]
        assert got == [peft_greedy(folder, mine[n], PROMPTS[0], NEW) for n in names]
        stats = llm.engine.lora.stats
        reads[cpu] = (stats.loads, stats.file_reads)
        assert_idle(llm)
    assert reads == {2: (5, 2), 1: (5, 5)}
