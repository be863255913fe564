"""When the engine turns the decode megakernel on (engine/model_runner.py): on CUDA only, by default up to
the largest hidden size at which it is faster, on request beyond it, never when turned off."""

from tinyvllm.engine.args import EngineArgs, add_engine_cli_args, engine_args_from_cli
from tinyvllm.engine.model_runner import MEGAKERNEL_MAX_HIDDEN, wants_megakernel


def test_default_is_by_size_on_cuda_only():
    assert wants_megakernel(None, "cuda", 2048) and MEGAKERNEL_MAX_HIDDEN == 2048
    assert not wants_megakernel(None, "cuda", 4096)
    assert not wants_megakernel(None, "cpu", 2048) and not wants_megakernel(True, "cpu", 2048)


def test_flag_forces_either_way():
    assert wants_megakernel(True, "cuda", 4096)
    assert not wants_megakernel(False, "cuda", 2048)


def test_cli_flag_reaches_engine_args():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    assert engine_args_from_cli(parser.parse_args([])).decode_megakernel is None
    assert engine_args_from_cli(parser.parse_args(["--decode-megakernel"])).decode_megakernel is True
    assert engine_args_from_cli(parser.parse_args(["--no-decode-megakernel"])).decode_megakernel is False
    assert EngineArgs().decode_megakernel is None
