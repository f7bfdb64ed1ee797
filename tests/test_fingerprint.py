"""The default tier layout name: every setting that changes a block's K/V changes it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvstore.engine.fingerprint import model_fingerprint
from kvstore.models.model import DecoderModel, RopeScaling, tiny_llama


def twin(**changes) -> DecoderModel:
    """A tiny Llama with the same weights as ``base()`` and these config changes."""
    torch.manual_seed(0)
    ref = DecoderModel(tiny_llama())
    model = DecoderModel(dataclasses.replace(tiny_llama(), **changes))
    model.load_state_dict(ref.state_dict())
    return model


def test_equal_models_get_equal_names():
    assert model_fingerprint(twin()) == model_fingerprint(twin())
    assert model_fingerprint(twin(), 16) == model_fingerprint(twin(), 16)


@pytest.mark.parametrize("changes", [
    {"rope_theta": 500000.0},
    {"rms_norm_eps": 1e-5},
    {"rope_scaling": RopeScaling("linear", 2.0)},
    {"query_pre_attn_scalar": 8.0},
    {"attn_logit_softcap": 50.0},
    {"dtype": torch.bfloat16},
])
def test_a_setting_that_changes_kv_changes_the_name(changes):
    assert model_fingerprint(twin(**changes)) != model_fingerprint(twin())


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
