"""The default tier layout name: every setting that changes a block's K/V changes it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvstore.engine.fingerprint import model_fingerprint  # noqa: E402
from kvstore.models.hf import HFCausalLM  # noqa: E402
from kvstore.models.presets import build_preset  # noqa: E402


def twin(preset: str = "llama", dtype: torch.dtype = torch.float32, **changes) -> HFCausalLM:
    """A tiny preset with the same seeded weights as ``twin(preset)`` and these config
    changes."""
    return build_preset(preset, seed=0, dtype=dtype, **changes)


def test_equal_models_get_equal_names():
    assert model_fingerprint(twin()) == model_fingerprint(twin())
    assert model_fingerprint(twin(), 16) == model_fingerprint(twin(), 16)


@pytest.mark.parametrize(("preset", "changes"), [
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
    ("llama", {"rms_norm_eps": 1e-5}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
    ("llama", {"dtype": torch.bfloat16}),
    ("gemma2", {"query_pre_attn_scalar": 8}),
    ("gemma2", {"attn_logit_softcapping": 50.0}),
])
def test_a_setting_that_changes_kv_changes_the_name(preset, changes):
    assert model_fingerprint(twin(preset, **changes)) != model_fingerprint(twin(preset))


def test_block_size_and_weights_change_the_name():
    assert model_fingerprint(twin(), 16) != model_fingerprint(twin(), 32)
    other = twin()
    with torch.no_grad():
        next(other.parameters()).view(-1)[0] += 1
    assert model_fingerprint(other) != model_fingerprint(twin())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="torch.nn.Module"):
        model_fingerprint("llama")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        model_fingerprint(twin(), 0)


def test_the_cache_core_does_not_hash_weights():
    import kvstore.tiers.connector as connector

    assert not hasattr(connector, "model_fingerprint")
