"""scripts/with_decode_config.py: the command line with decode attention's default config changed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tinyvllm.kernels.decode_attention import DEFAULT_CONFIG

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "with_decode_config.py"


def load():
    spec = importlib.util.spec_from_file_location("with_decode_config", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fields_are_set_with_their_types():
    cfg = load().changed(["prefix_stream=1", "prefix_splits=2", "num_stages=5"])
    assert cfg == DEFAULT_CONFIG._replace(prefix_stream=True, prefix_splits=2, num_stages=5)
    assert cfg.prefix_stream is True and type(cfg.prefix_splits) is int


def test_an_unknown_field_is_refused_by_name():
    with pytest.raises(SystemExit, match="'prefix_streams' is not a DecodeConfig field"):
        load().changed(["prefix_streams=1"])
