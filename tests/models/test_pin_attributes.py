"""`CausalLM.pin_attributes`: submodules and parameters read from the instance dict, and still right after a
module or parameter is replaced."""

from __future__ import annotations

import torch
from torch import nn

from inferd.engine.engine import LLM
from inferd.models.layers import Linear
from inferd.sampling import SamplingParams


def test_an_engine_pins_its_model_and_the_pins_are_the_registered_objects(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", max_model_len=128, kv_cache_memory=8 * 2**20)
    model = llm.engine.model
    modules = list(model.modules())
    assert len(modules) > 10
    for module in modules:
        for name, value in [*module._modules.items(), *module._parameters.items()]:
            if value is not None:
                assert module.__dict__[name] is value, (type(module).__name__, name)
        assert not set(module._buffers) & set(module.__dict__)  # buffers are not pinned


def test_replacing_a_pinned_module_or_parameter_drops_the_pin(tiny_model):
    llm = LLM(str(tiny_model), dtype="float32", max_model_len=128, kv_cache_memory=8 * 2**20)
    layer = llm.engine.model.model.layers[0]
    old = layer.mlp.down_proj
    new = Linear(old.in_features, old.out_features, bias=False)  # a dense float32 layer: F.linear
    new.weight = nn.Parameter(torch.zeros(old.out_features, old.in_features), requires_grad=False)
    layer.mlp.down_proj = new
    assert layer.mlp.down_proj is new and layer.mlp._modules["down_proj"] is new
    assert layer.mlp.down_proj.weight is new.weight
    calls = []
    new.register_forward_hook(lambda *_: calls.append(1))  # the forward reads the new module, not a stale pin
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
    assert calls
