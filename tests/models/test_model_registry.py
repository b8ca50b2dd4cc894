"""The model registry: config.json picks the architecture, and an architecture registered from outside
the core (tests/toy_arch.py: V4 plus one tensor and one cache branch two layers share) loads, generates,
prefix-caches, survives preemption and speculates with no edit to deepinfer_core."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import toy_arch
from engine_fixtures import greedy, make_llm, make_prompt, run_tokens, tiny_path  # noqa: F401
from safetensors.torch import load_file, save_file

from deepinfer_core.config import ModelConfig, UnsupportedModelError
from deepinfer_core.model.cache import bytes_per_block, bytes_per_state_slot
from deepinfer_core.model.loader import CheckpointError
from deepinfer_core.models import load_model, register_architecture, resolve_architecture
from deepinfer_core.models.registry import supported_architectures

register_architecture(toy_arch.NAME, "toy_arch", (toy_arch.MODEL_TYPE,))


@pytest.fixture(scope="module")
def toy_path(tiny_path, tmp_path_factory):  # noqa: F811
    """The tiny checkpoint (MTP included) as the toy architecture, with its extra tensor."""
    src = tiny_path("tiny")
    dst = tmp_path_factory.mktemp("toy")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    config = json.loads((dst / "config.json").read_text())
    config.update(architectures=[toy_arch.NAME], model_type=toy_arch.MODEL_TYPE)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    d, hd = config["hidden_size"], config["head_dim"]
    tensors[toy_arch.TOY_PROJ] = (torch.randn(d, hd, generator=gen) / hd**0.5).to(torch.bfloat16)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_config_picks_the_architecture_by_name_then_model_type(toy_path, tiny_path):  # noqa: F811
    assert type(ModelConfig.from_pretrained(toy_path)) is toy_arch.ToyConfig
    assert resolve_architecture({"model_type": "deepseek_v4"}).name == "DeepseekV4ForCausalLM"
    assert resolve_architecture({"architectures": ["Unknown", toy_arch.NAME]}).name == toy_arch.NAME
    assert {"DeepseekV4ForCausalLM", toy_arch.NAME} <= set(supported_architectures())
    with pytest.raises(UnsupportedModelError, match="DeepseekV4ForCausalLM.*'toy_deepseek_v4'"):
        resolve_architecture({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "toy_deepseek_v4"})
    with pytest.raises(UnsupportedModelError, match="'llama'.*DeepseekV4ForCausalLM"):
        resolve_architecture({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_the_shared_branch_is_one_pool_counted_once(toy_path, tiny_path):  # noqa: F811
    toy, base = ModelConfig.from_pretrained(toy_path), ModelConfig.from_pretrained(tiny_path("tiny"))
    layout = toy.architecture.cache_layout(toy)
    assert layout.layers[1].branches["toy"] == layout.layers[3].branches["toy"]
    assert layout.layers[1].owned >= {"toy"} and "toy" not in layout.layers[3].owned
    (comp, window), (base_comp, base_window) = (bytes_per_block(c, 16, torch.float32) for c in (toy, base))
    toy_pool = 16 // toy_arch.RATE * toy.head_dim * 4  # one block of the toy pool, float32, counted once
    assert (comp, window) == (base_comp + toy_pool, base_window)
    assert bytes_per_state_slot(toy, torch.float32) == bytes_per_state_slot(base, torch.float32)  # no ring


def test_the_extra_tensor_is_checked_and_changes_the_output(toy_path, tiny_path, tmp_path):  # noqa: F811
    model = load_model(toy_path, dtype=torch.float64)
    assert isinstance(model, toy_arch.ToyModel)
    assert model.weights.toy_proj.weight.shape == (model.cfg.hidden_size, model.cfg.head_dim)
    broken = tmp_path / "broken"
    shutil.copytree(toy_path, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors[toy_arch.TOY_PROJ]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="toy_proj"):
        load_model(broken)


def test_generate_prefix_cache_preemption_and_speculation(toy_path, tiny_path, make_llm):  # noqa: F811
    prefix = make_prompt(40, seed=3)
    prompts = [prefix + make_prompt(6 + i, seed=10 + i) for i in range(4)]
    params = greedy(max_tokens=14)
    kw = dict(dtype="float64", enable_prefix_caching=False)
    reference = run_tokens(make_llm(toy_path, **kw), prompts, params)
    v4 = run_tokens(make_llm(tiny_path("tiny"), **kw), prompts, params)
    assert reference != v4  # the toy's tensor and branch take part in the forward

    cached = make_llm(toy_path, dtype="float64", enable_prefix_caching=True)
    assert run_tokens(cached, prompts[:1], params) == reference[:1]
    assert run_tokens(cached, prompts, params) == reference
    assert cached.llm_engine.prefix_cache_stats()["hit_tokens"] > 0

    tight = make_llm(toy_path, dtype="float64", num_blocks=10, num_window_blocks=8, max_num_batched_tokens=32,
                     enable_prefix_caching=False)
    assert run_tokens(tight, prompts, params) == reference
    assert tight.llm_engine.scheduler.num_preemptions > 0

    spec = make_llm(toy_path, dtype="float64", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert run_tokens(spec, prompts, params) == reference
    cache = spec.llm_engine.cache
    assert cache.entries["toy"][1] is cache.entries["toy"][3]
