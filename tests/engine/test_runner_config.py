"""The configuration surface: EngineArgs fields, their generated CLI flags, and the RunnerConfig they give
the model runner (which paths are on, e.g. when the decode megakernel is tried)."""

import argparse
import dataclasses

import pytest

from tinyvllm.config import RunnerConfig
from tinyvllm.engine.args import EngineArgs, add_engine_cli_args, engine_args_from_cli
from tinyvllm.engine.paths.executor import wants_megakernel


def _parse(argv: list[str]) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    return engine_args_from_cli(parser.parse_args(argv))


def test_megakernel_default_is_by_size_on_cuda_only():
    """On by default on CUDA for hidden sizes up to the limit (1B's 2,048, 8B's 4,096, and the padded
    3B's 3,072 and Qwen3-4B's 2,560), off above it and off the GPU."""
    cfg = RunnerConfig()
    assert cfg.megakernel_max_hidden == 8192
    assert wants_megakernel(cfg, "cuda", 2048) and wants_megakernel(cfg, "cuda", 4096)
    assert wants_megakernel(cfg, "cuda", 3072) and wants_megakernel(cfg, "cuda", 2560)
    assert not wants_megakernel(cfg, "cuda", 16384)
    # FP8 weights: the power-of-two sizes only (the padded ones are untimed with FP8 weights)
    assert wants_megakernel(cfg, "cuda", 2048, fp8_weights=True)
    assert not wants_megakernel(cfg, "cuda", 3072, fp8_weights=True)
    assert wants_megakernel(RunnerConfig(decode_megakernel=True), "cuda", 3072, fp8_weights=True)
    assert not wants_megakernel(cfg, "cpu", 2048)
    assert not wants_megakernel(RunnerConfig(decode_megakernel=True), "cpu", 2048)
    assert not wants_megakernel(RunnerConfig(megakernel_max_hidden=2048), "cuda", 4096)


def test_megakernel_flag_forces_either_way():
    assert wants_megakernel(RunnerConfig(decode_megakernel=True), "cuda", 4096)
    assert not wants_megakernel(RunnerConfig(decode_megakernel=False), "cuda", 2048)


def test_no_flags_give_the_default_engine_args():
    assert _parse([]) == EngineArgs()


def test_every_field_has_a_flag_that_reaches_it():
    """One flag per EngineArgs field, spelled as vLLM spells it; a non-default value reaches the field."""
    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for f in dataclasses.fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in flags, f.name
    args = _parse(
        [
            "--no-decode-megakernel",
            "--max-num-seqs",
            "4",
            "--enforce-eager",
            "--kernel-copy-max-rows",
            "2",
            "--fused-max-tokens",
            "3",
            "--no-pruned-lm-head",
            "--gpu-memory-utilization",
            "0.5",
        ]
    )
    assert args.decode_megakernel is False and args.max_num_seqs == 4 and args.enforce_eager
    assert args.kernel_copy_max_rows == 2 and args.fused_max_tokens == 3 and not args.pruned_lm_head
    assert args.gpu_memory_utilization == 0.5
    assert _parse(["--decode-megakernel"]).decode_megakernel is True


def test_runner_config_carries_every_runner_field():
    args = EngineArgs(fused_max_tokens=4, cascade_min_batch=7, graph_io_max_rows=0, sample_in_lm_head=False)
    cfg = args.runner_config("cuda")
    assert (cfg.fused_max_tokens, cfg.cascade_min_batch, cfg.graph_io_max_rows) == (4, 7, 0)
    assert not cfg.sample_in_lm_head and cfg.cuda_graphs
    assert not args.replace(enforce_eager=True).runner_config("cuda").cuda_graphs
    assert not args.runner_config("cpu").cuda_graphs


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fused_max_tokens": 0}, "fused_max_tokens"),
        ({"fused_max_tokens": 17}, "fused_max_tokens"),
        ({"graph_io_max_rows": 2}, "graph_io_max_rows"),
        ({"cascade_min_batch": -1}, "cascade_min_batch"),
    ],
)
def test_bad_runner_values_are_clear_errors(change, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**change).runner_config("cpu")
