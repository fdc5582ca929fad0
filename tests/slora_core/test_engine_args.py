"""EngineConfig's flags and environment variables, generated from its fields."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from slora_core.config import ConfigError, EngineConfig
from slora_core.engine_args import (
    HELP,
    add_engine_args,
    engine_cli_args,
    engine_config_from_args,
)


def parse(argv: list[str], env: dict[str, str] | None = None, **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, env=env or {}, **kw)
    return parser.parse_args(argv)


def test_every_field_has_help_a_flag_and_the_config_defaults():
    assert set(HELP) == {f.name for f in fields(EngineConfig)}
    assert engine_config_from_args(parse([])) == EngineConfig()


def test_flags_that_scripts_and_tests_use_keep_their_names():
    args = parse(["--num-pages", "128", "--max-num-seqs", "1", "--max-queue", "1",
                  "--async-steps", "--no-mixed-graphs", "--max-model-len", "300",
                  "--block-size", "32", "--dtype", "float16"])
    config = engine_config_from_args(args)
    assert (config.num_pages, config.max_num_seqs, config.max_queue) == (128, 1, 1)
    assert config.async_steps and not config.mixed_graphs and config.cuda_graphs
    assert (config.max_model_len, config.block_size, config.dtype) == (300, 32, "float16")


def test_environment_variables_sit_between_defaults_and_flags():
    env = {"SLORA_NUM_PAGES": "99", "SLORA_ASYNC_STEPS": "true", "SLORA_MAX_MODEL_LEN": "none"}
    config = engine_config_from_args(parse([], env))
    assert config.num_pages == 99 and config.async_steps and config.max_model_len is None
    assert engine_config_from_args(parse(["--num-pages", "7"], env)).num_pages == 7
    with pytest.raises(SystemExit, match="SLORA_NUM_PAGES='lots'"):
        parse([], {"SLORA_NUM_PAGES": "lots"})
    with pytest.raises(SystemExit, match="SLORA_CUDA_GRAPHS='maybe'"):
        parse([], {"SLORA_CUDA_GRAPHS": "maybe"})


def test_command_defaults_skips_and_overrides():
    args = parse([], defaults={"max_num_seqs": 256}, skip=("max_queue",))
    assert not hasattr(args, "max_queue") and args.max_num_seqs == 256
    assert engine_config_from_args(args, max_queue=5).max_queue == 5
    with pytest.raises(ValueError, match="not EngineConfig fields"):
        parse([], skip=("num_page",))
    with pytest.raises(ConfigError, match="num_pages must be positive"):
        engine_config_from_args(parse(["--num-pages", "0"]))


def test_cli_args_round_trip_through_the_parser():
    values = {"num_pages": 64, "max_model_len": None, "async_steps": True,
              "cuda_graphs": False, "device": "cpu"}
    args = parse(engine_cli_args(values))
    assert {k: getattr(args, k) for k in values} == values


def test_the_adapter_cap_follows_the_batch_unless_set():
    """max_adapters_per_batch defaults to no cap below max_num_seqs; a set value is kept; a
    flag or variable of `none` means the default."""
    assert EngineConfig().adapter_cap == 64
    assert EngineConfig(max_num_seqs=256).adapter_cap == 256
    assert EngineConfig(max_num_seqs=256, max_adapters_per_batch=32).adapter_cap == 32
    with pytest.raises(ConfigError, match="max_adapters_per_batch"):
        EngineConfig(max_adapters_per_batch=0)
    parser = argparse.ArgumentParser()
    add_engine_args(parser, env={})
    args = parser.parse_args(["--max-num-seqs", "128", "--max-adapters-per-batch", "none"])
    assert engine_config_from_args(args).adapter_cap == 128


def test_async_steps_default_on_for_one_cuda_device_only():
    """Unset, asynchronous steps are on for a single CUDA device and off on the CPU and with
    tensor parallelism; a flag or variable decides either way, and `none` means unset."""
    assert EngineConfig().async_steps is None and not EngineConfig().steps_async
    assert EngineConfig(device="cuda").steps_async
    assert EngineConfig(device="cuda:1").steps_async
    assert not EngineConfig(device="cuda", tensor_parallel_size=2).steps_async
    assert not EngineConfig(device="cuda", async_steps=False).steps_async
    assert EngineConfig(device="cpu", async_steps=True).steps_async
    assert engine_config_from_args(parse(["--no-async-steps"])).async_steps is False
    assert engine_config_from_args(parse([], {"SLORA_ASYNC_STEPS": "none"})).async_steps is None
    assert engine_config_from_args(parse([], {"SLORA_ASYNC_STEPS": "off"})).async_steps is False
    with pytest.raises(SystemExit, match="SLORA_ASYNC_STEPS='sometimes'"):
        parse([], {"SLORA_ASYNC_STEPS": "sometimes"})
    for value in (None, True, False):
        assert parse(engine_cli_args({"async_steps": value})).async_steps is value
    assert engine_cli_args({"async_steps": None}) == []
