"""ToMeConfig: defaults, validation, immutability."""

from __future__ import annotations

import dataclasses

import pytest

from tome_processors import ToMeConfig


def test_defaults_follow_tomesd_except_auto_downsample():
    config = ToMeConfig()
    assert (config.ratio, config.sx, config.sy, config.use_rand) == (0.5, 2, 2, True)
    assert (config.merge_attn, config.merge_crossattn, config.merge_mlp) == (True, False, False)
    assert config.max_downsample == "auto"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ratio": -0.1}, "Expected ratio between 0 and 0.75"),
        ({"ratio": 0.8}, r"cap 1 - 1/\(sx\*sy\)"),
        ({"ratio": 0.8, "sx": 4, "sy": 4}, None),  # allowed: cap 0.9375
        ({"ratio": "0.5"}, "Expected ratio to be a number"),
        ({"ratio": True}, "Expected ratio to be a number"),
        ({"sx": 0}, "Expected sx to be an integer >= 1"),
        ({"sy": 1.5}, "Expected sy to be an integer >= 1"),
        ({"max_downsample": 3}, 'Expected max_downsample to be "auto", 1, 2, 4 or 8'),
        ({"max_downsample": "1"}, "Expected max_downsample"),
        ({"use_rand": 1}, "Expected use_rand to be a bool"),
        ({"merge_mlp": None}, "Expected merge_mlp to be a bool"),
        ({"seed": -1}, "Expected seed to be a non-negative integer"),
        ({"level_kv_factors": {3: 2}}, "Expected level_kv_factors keys among 1, 2, 4, 8"),
        ({"level_kv_factors": {2: 0}}, "Expected level_kv_factors values to be integers >= 1"),
        ({"level_kv_factors": {2: 1.5}}, "Expected level_kv_factors values to be integers >= 1"),
        ({"level_kv_factors": [2, 2]}, "Expected level_kv_factors to be a mapping"),
    ],
)
def test_validation(kwargs, message):
    if message is None:
        ToMeConfig(**kwargs)
        return
    with pytest.raises(ValueError, match=message):
        ToMeConfig(**kwargs)


def test_frozen_and_replace_validates():
    config = ToMeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.ratio = 0.1  # type: ignore[misc]
    assert config.replace(ratio=0.2).ratio == 0.2 and config.ratio == 0.5
    with pytest.raises(ValueError):
        config.replace(ratio=2.0)


def test_from_kwargs():
    base = ToMeConfig(ratio=0.3)
    assert ToMeConfig.from_kwargs(base) is base
    assert ToMeConfig.from_kwargs(base, sx=3).sx == 3
    with pytest.raises(TypeError, match="unknown"):
        ToMeConfig.from_kwargs(ratoi=0.1)
    with pytest.raises(TypeError, match="Expected config"):
        ToMeConfig.from_kwargs({"ratio": 0.1})  # type: ignore[arg-type]


def test_level_kv_factors_are_stored_as_sorted_pairs_and_pick_each_levels_window():
    config = ToMeConfig(mode="downsample_kv", kv_factor=4, level_kv_factors={4: 1, 2: 2})
    assert config.level_kv_factors == ((2, 2), (4, 1)) and hash(config) == hash(config.replace())
    assert [config.kv_factor_at(level) for level in (1, 2, 4, 8)] == [4, 2, 1, 4]
    assert ToMeConfig(kv_factor=3).kv_factor_at(2) == 3
