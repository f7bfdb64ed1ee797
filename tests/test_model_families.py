"""Model families and RoPE variants from ``config.json`` dicts, against transformers 5.24.

Each case is a tiny ``config.json`` shaped like a published one (same layer pattern,
window rule, RoPE parameters and head layout; reduced widths and depths), built by
transformers itself (``from_dict``, as ``from_pretrained`` does) with eager fp32
attention and peaked random weights, and by :meth:`ModelConfig.from_hf` from the same
dict. Logits are compared at positions past the original context
(``original_max_position_embeddings``) and past the window, through the dense reference
attention and through :class:`LLMEngine` (prefix hits, partial hits, forks, preemption
and eviction). The config-reading rules (class defaults for missing keys, RoPE
spellings, errors) are checked on dicts alone.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from test_engine import (  # noqa: E402
    BLOCK,
    check_engine_against_hf,
)
from test_models_hf import ATOL, hf_logits, our_logits, random_prompts, randomize_  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from kvstore.cli import main as cli_main  # noqa: E402
from kvstore.models.model import (  # noqa: E402
    HF_CONFIG_DEFAULTS,
    PRESETS,
    SUPPORTED_MODEL_TYPES,
    DecoderModel,
    ModelConfig,
    RopeScaling,
    load_checkpoint_dir,
    load_state_dict_from_hf,
    rope_frequencies,
)

# ----------------------------------------------------------------------------- configs

# Llama-3.2-1B: llama3 RoPE (factor 32, low/high 1/4, theta 5e5), GQA 4:1, tied, eps 1e-5.
# original_max_position_embeddings 40 puts head_dim 16's frequencies in all three bands.
LLAMA32 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 256, "head_dim": 16,
    "max_position_embeddings": 256, "mlp_bias": False, "num_attention_heads": 4,
    "num_hidden_layers": 3, "num_key_value_heads": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 40, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 256,
}
# Gemma-3-4B's text_config: only the keys it spells out (no query_pre_attn_scalar,
# rms_norm_eps, rope_theta, rope_local_base_freq, ...), linear factor 8 on global layers.
GEMMA3_4B = {
    "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 256,
    "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 256, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 8,
}
# Qwen2.5-7B-Instruct with the YaRN block its model card recommends (legacy "type" key):
# 28:4 heads, q/k/v biases, window configured but off (use_sliding_window false).
QWEN25_YARN = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 112, "intermediate_size": 224, "max_position_embeddings": 256,
    "max_window_layers": 3, "num_attention_heads": 7, "num_hidden_layers": 3,
    "num_key_value_heads": 1, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 256,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 64, "type": "yarn"},
}
# Qwen2 with its window on: layers from max_window_layers on slide.
QWEN2_SLIDING = {
    "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
    "max_window_layers": 2, "use_sliding_window": True, "sliding_window": 8,
    "rope_theta": 10000.0, "vocab_size": 256, "max_position_embeddings": 256,
}
# ... or names them in layer_types, which wins over max_window_layers.
QWEN2_LAYER_TYPES = dict(
    QWEN2_SLIDING, max_window_layers=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
)
# Qwen3-8B: head_dim wider than hidden / heads, q/k norms, 32:8 heads, no window.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 192,
    "max_position_embeddings": 40, "max_window_layers": 36, "num_attention_heads": 4,
    "num_hidden_layers": 3, "num_key_value_heads": 1, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 256,
}
# Qwen3 with YaRN in transformers 5.x spelling; max_position_embeddings / original (1.25)
# disagrees with factor 4, and transformers uses the explicit factor.
QWEN3_YARN = dict(
    QWEN3_8B, rope_scaling=None,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                     "rope_theta": 1000000.0},
)

CASES: dict[str, dict[str, Any]] = {
    "llama3.2-llama3": LLAMA32,
    "gemma3-4b-linear": GEMMA3_4B,
    "qwen2.5-yarn": QWEN25_YARN,
    "qwen2-sliding": QWEN2_SLIDING,
    "qwen2-layer-types": QWEN2_LAYER_TYPES,
    "qwen3-8b": QWEN3_8B,
    "qwen3-yarn": QWEN3_YARN,
}
ENGINE_CASES = ["llama3.2-llama3", "gemma3-4b-linear", "qwen2.5-yarn", "qwen2-sliding",
                "qwen3-8b", "qwen3-yarn"]


def hf_config_from_dict(d: dict[str, Any]) -> transformers.PreTrainedConfig:
    """The config transformers builds from a ``config.json`` dict."""
    return transformers.CONFIG_MAPPING[d["model_type"]].from_dict(copy.deepcopy(d))


def original_context(cfg: ModelConfig) -> int:
    """Positions a test must pass: the scaled RoPE's original context, else 16."""
    scalings = [s for s in (cfg.rope_scaling, cfg.local_rope_scaling) if s is not None]
    return max([s.original_max_position_embeddings or 16 for s in scalings] + [16])


def build_pair_from_dict(
    d: dict[str, Any], seed: int = 0
) -> tuple[transformers.PreTrainedModel, DecoderModel]:
    """A randomised HF model built from ``d`` and our model from the same dict."""
    hf_cfg = hf_config_from_dict(d)
    hf = transformers.AutoModelForCausalLM.from_config(
        hf_cfg, attn_implementation="eager", dtype=torch.float32
    ).eval()
    randomize_(hf, d["model_type"].startswith("gemma"), seed)
    ours = DecoderModel(ModelConfig.from_hf(copy.deepcopy(d))).eval()
    load_state_dict_from_hf(ours, hf.state_dict())
    return hf, ours


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[transformers.PreTrainedModel, DecoderModel]]:
    return {name: build_pair_from_dict(d) for name, d in CASES.items()}


# ----------------------------------------------------------------------------- reading


@pytest.mark.parametrize("name", list(CASES))
def test_dict_and_object_give_the_same_config(name: str) -> None:
    d = CASES[name]
    from_dict = ModelConfig.from_hf(copy.deepcopy(d))
    hf_cfg = hf_config_from_dict(d)
    assert from_dict == ModelConfig.from_hf(hf_cfg)
    if hasattr(hf_cfg, "layer_types"):
        assert from_dict.layer_types == tuple(hf_cfg.layer_types)


def test_rope_variants_read_from_each_spelling() -> None:
    llama = ModelConfig.from_hf(LLAMA32)
    assert llama.rope_theta == 500000.0
    assert llama.rope_scaling == RopeScaling("llama3", 32.0, 40, low_freq_factor=1.0,
                                             high_freq_factor=4.0)
    gemma = ModelConfig.from_hf(GEMMA3_4B)
    assert (gemma.rope_theta, gemma.rope_scaling) == (1e6, RopeScaling("linear", 8.0))
    assert (gemma.local_rope_theta, gemma.local_rope_scaling) == (1e4, None)
    assert gemma.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    qwen = ModelConfig.from_hf(QWEN25_YARN)
    assert qwen.rope_scaling == RopeScaling("yarn", 4.0, 64,
                                            attention_factor=0.1 * math.log(4.0) + 1.0)
    assert qwen.qkv_bias and not qwen.attention_bias and qwen.sliding_window is None
    # transformers 5.x spelling, nested by layer type for Gemma 3.
    nested = dict(GEMMA3_4B, rope_scaling=None, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert ModelConfig.from_hf(nested) == gemma
    flat = {k: v for k, v in LLAMA32.items() if k not in ("rope_scaling", "rope_theta")}
    flat["rope_parameters"] = dict(LLAMA32["rope_scaling"], rope_theta=500000.0)
    assert ModelConfig.from_hf(flat) == llama
    # legacy rope_scaling wins over rope_parameters, as in transformers.
    both = dict(LLAMA32, rope_parameters={"rope_type": "linear", "factor": 2.0})
    assert ModelConfig.from_hf(both) == llama
    # A top-level original_max_position_embeddings (Phi-3 style) wins over the rope dict's.
    phi = dict(QWEN25_YARN, original_max_position_embeddings=32)
    assert ModelConfig.from_hf(phi).rope_scaling.original_max_position_embeddings == 32
    hf = transformers.AutoModelForCausalLM.from_config(hf_config_from_dict(phi))
    assert hf.config.rope_parameters["original_max_position_embeddings"] == 32


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_missing_keys_take_transformers_defaults(model_type: str) -> None:
    """A dict naming only the model type reads as transformers' default config."""
    assert set(HF_CONFIG_DEFAULTS) == set(SUPPORTED_MODEL_TYPES)
    hf_default = transformers.CONFIG_MAPPING[model_type]()
    assert ModelConfig.from_hf({"model_type": model_type}) == ModelConfig.from_hf(hf_default)


def test_gemma3_text_config_without_optional_keys() -> None:
    """Gemma-3-4B's text_config lacks query_pre_attn_scalar and rms_norm_eps (was a bare
    TypeError), and tie_word_embeddings (was read as False)."""
    cfg = ModelConfig.from_hf(GEMMA3_4B)
    assert cfg.query_pre_attn_scalar == 256.0
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.tie_word_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh"


def test_mistral_dict_without_sliding_window_uses_4096() -> None:
    d = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 1, "num_hidden_layers": 2, "intermediate_size": 128,
         "vocab_size": 256, "rms_norm_eps": 1e-5}
    cfg = ModelConfig.from_hf(d)
    assert cfg.sliding_window == 4096 == hf_config_from_dict(d).sliding_window
    assert cfg.layer_types == ("sliding_attention",) * 2
    assert ModelConfig.from_hf(dict(d, sliding_window=None)).sliding_layers == ()


@pytest.mark.parametrize(
    "changes, sliding",
    [
        ({}, (2, 3)),
        ({"use_sliding_window": False}, ()),
        ({"max_window_layers": 4}, ()),
        ({"max_window_layers": 0}, (0, 1, 2, 3)),
        ({"layer_types": ["sliding_attention", "full_attention"] * 2}, (0, 2)),
        ({"layer_types": ["full_attention"] * 4}, ()),
        ({"sliding_window": None, "use_sliding_window": False}, ()),
    ],
)
def test_qwen_sliding_layers_follow_transformers(changes: dict, sliding: tuple) -> None:
    for model_type in ("qwen2", "qwen3"):
        d = dict(QWEN2_SLIDING, model_type=model_type, **changes)
        cfg = ModelConfig.from_hf(d)
        hf_cfg = hf_config_from_dict(d)
        assert cfg.sliding_layers == sliding
        assert cfg.layer_types == tuple(hf_cfg.layer_types)
        assert cfg.sliding_window == (hf_cfg.sliding_window if sliding else None)
        assert cfg == ModelConfig.from_hf(hf_cfg)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"rms_norm_eps": "1e-6"}, r"'rms_norm_eps' must be a number, got '1e-6'"),
        ({"rms_norm_eps": None}, r"'rms_norm_eps' must be a number"),
        ({"num_hidden_layers": 2.5}, r"'num_hidden_layers' must be an integer"),
        ({"hidden_size": True}, r"'hidden_size' must be an integer"),
        ({"tie_word_embeddings": "yes"}, r"'tie_word_embeddings' must be true or false"),
        ({"hidden_act": 3}, r"'hidden_act' must be a string"),
        ({"rope_theta": "1e6"}, r"'rope_theta' must be a number"),
        ({"rope_scaling": "yarn"}, r"'rope_scaling' must be a dict"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "8"}},
         r"rope_scaling\['factor'\] must be a number"),
        ({"layer_types": ["full_attention"]}, r"layer_types has 1 entries"),
        ({"layer_types": ["chunked_attention"] * 4}, r"unsupported entries \['chunked_attention'\]"),
    ],
)
def test_wrong_types_name_the_key(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(dict(QWEN2_SLIDING, **changes))


def test_gemma_null_query_pre_attn_scalar_names_the_key() -> None:
    with pytest.raises(ValueError, match="'query_pre_attn_scalar' must be a number, got None"):
        ModelConfig.from_hf(dict(GEMMA3_4B, query_pre_attn_scalar=None))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
         r"unsupported RoPE type 'dynamic' in rope_scaling; supported: default, linear, llama3"),
        ({"rope_scaling": None, "rope_parameters": {
            "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 32}},
         r"unsupported RoPE type 'longrope' in rope_parameters"),
        ({"rope_scaling": {"rope_type": "proportional", "partial_rotary_factor": 0.5}},
         r"unsupported RoPE type 'proportional'"),
        ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 in rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
         r"rope_scaling: RoPE type 'llama3' needs 'low_freq_factor'"),
        ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 8}},
         r"RoPE type 'yarn' needs 'factor'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "mrope_section": [2, 3, 3]}},
         r"keys \['mrope_section'\] are not used by RoPE type 'linear'"),
        ({"rope_scaling": {"rope_type": "default", "factor": 2.0}},
         r"keys \['factor'\] are not used by RoPE type 'default'"),
    ],
)
def test_unsupported_rope_is_an_error_naming_the_key(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(dict(LLAMA32, **changes))


def test_other_unsupported_configs() -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'phi3'"):
        ModelConfig.from_hf({"model_type": "phi3"})
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf({"model_type": "gemma3", "text_config": GEMMA3_4B})
    with pytest.raises(ValueError, match="must be nested by layer type"):
        ModelConfig.from_hf(dict(GEMMA3_4B, rope_scaling=None,
                                 rope_parameters={"rope_type": "linear", "factor": 8.0}))
    with pytest.raises(ValueError, match="transformers cannot run this config"):
        ModelConfig.from_hf(dict(QWEN2_LAYER_TYPES, use_sliding_window=False))
    with pytest.raises(ValueError, match="bidirectional"):
        ModelConfig.from_hf(dict(GEMMA3_4B, use_bidirectional_attention=True))


# ----------------------------------------------------------------------------- frequencies


ROPES: list[tuple[str, float, int, dict[str, Any]]] = [
    ("linear", 1e6, 16, {"rope_type": "linear", "factor": 8.0}),
    ("llama3", 500000.0, 16, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 40}),
    ("llama3-wide", 500000.0, 64, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}),
    ("yarn", 1e6, 32, {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 32}),
    ("yarn-untruncated", 1e4, 16, {"rope_type": "yarn", "factor": 4.0, "truncate": False,
                                   "beta_fast": 16, "beta_slow": 2,
                                   "original_max_position_embeddings": 64}),
    ("yarn-mscale", 1e4, 16, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                              "mscale_all_dim": 0.707, "original_max_position_embeddings": 16}),
    ("yarn-attention-factor", 1e4, 16, {"rope_type": "yarn", "factor": 2.0,
                                        "attention_factor": 0.9,
                                        "original_max_position_embeddings": 16}),
    ("yarn-no-factor", 1e4, 16, {"rope_type": "yarn", "factor": None,
                                 "original_max_position_embeddings": 32}),
]


@pytest.mark.parametrize("name, theta, head_dim, rope", ROPES, ids=[r[0] for r in ROPES])
def test_rope_frequencies_match_transformers(
    name: str, theta: float, head_dim: int, rope: dict[str, Any]
) -> None:
    d = {"model_type": "llama", "hidden_size": 4 * head_dim, "num_attention_heads": 4,
         "head_dim": head_dim, "max_position_embeddings": 128, "rope_theta": theta,
         "rope_scaling": rope}
    hf_cfg = hf_config_from_dict(d)
    ref_inv_freq, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg)
    cfg = ModelConfig.from_hf(d)
    inv_freq, scale = rope_frequencies(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)
    # Each case changes the frequencies (and a llama3 case has all three bands).
    plain, _ = rope_frequencies(theta, head_dim)
    assert not torch.allclose(inv_freq, plain)
    if name == "llama3":
        ratio = plain / inv_freq
        assert (ratio == 1).any() and (ratio == 32).any() and ((ratio > 1) & (ratio < 32)).any()


# ----------------------------------------------------------------------------- vs HF


def without_scaling(model: DecoderModel, **changes: Any) -> DecoderModel:
    """``model``'s weights under another RoPE configuration."""
    other = DecoderModel(dataclasses.replace(model.config, **changes)).eval()
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf_past_original_context(name: str, pairs: dict) -> None:
    hf, ours = pairs[name]
    cfg = ours.config
    past = original_context(cfg) + 2 * (cfg.sliding_window or 8) + 5
    seqs = random_prompts([past, 7, 1, 2 * BLOCK + 1], cfg.vocab_size, seed=11)
    refs = [hf_logits(hf, s) for s in seqs]
    for out, ref in zip(our_logits(ours, seqs), refs, strict=True):
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)
    assert refs[0].std(dim=0).mean() > 0.2  # position-dependent outputs
    # Dropping the scaling (the old from_hf's silent behaviour) is visibly wrong, and
    # Gemma 3's scaling belongs on the global layers only.
    wrong: list[DecoderModel] = []
    if cfg.rope_scaling is not None:
        wrong.append(without_scaling(ours, rope_scaling=None))
    if cfg.local_rope_theta is not None and cfg.rope_scaling is not None:
        wrong.append(without_scaling(ours, local_rope_scaling=cfg.rope_scaling))
    for model in wrong:
        assert (our_logits(model, seqs[:1])[0] - refs[0]).abs().max() > 1e-2


def test_checkpoint_dir_with_yarn(pairs: dict, tmp_path: Path) -> None:
    """save_pretrained writes transformers 5.x's rope_parameters; the loaded model matches."""
    hf, ours = pairs["qwen3-yarn"]
    hf.save_pretrained(tmp_path)
    model = load_checkpoint_dir(tmp_path)
    assert model.config == ours.config
    seq = random_prompts([45], model.config.vocab_size, seed=12)
    torch.testing.assert_close(our_logits(model, seq)[0], hf_logits(hf, seq[0]), atol=ATOL,
                               rtol=1e-4)


# ----------------------------------------------------------------------------- engine


@pytest.mark.parametrize("name", ENGINE_CASES)
def test_engine_matches_hf(name: str, pairs: dict) -> None:
    """Through LLMEngine past the original context and the window: a chunked shared-prefix
    batch (caching on and off agree), a partial hit after a finish, a fork, and a pool small
    enough to preempt and evict."""
    hf, model = pairs[name]
    cfg = model.config
    check_engine_against_hf(hf, model, original_context(cfg) + (cfg.sliding_window or 0) + 6,
                            max_tokens=6, batched_tokens=24, small_batched_tokens=32)


# ----------------------------------------------------------------------------- presets, CLI


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_generate_accepts_qwen_presets(family: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert f"tiny_{family}" in PRESETS
    assert cli_main(["generate", "--model", family, "--max-tokens", "3", "--block-size", "4",
                     "--device", "cpu"]) == 0
    assert "hit_tokens" in capsys.readouterr().out
