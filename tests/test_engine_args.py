"""EngineArgs / ServerArgs: each option declared once (field, default, help, flag), checked once, and
resolved against the device and the model into EngineConfig."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest
import torch

from compiled_engine import LLM
from compiled_engine.engine_args import (
    ATTENTION_BACKEND_CHOICES,
    COMPILE_POLICY_CHOICES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DTYPE_CHOICES,
    EngineArgs,
    ServerArgs,
)
from compiled_engine.entrypoints import cli
from compiled_engine.graphs.buckets import default_buckets
from compiled_engine.graphs.compiled_step import COMPILE_POLICIES
from compiled_engine.kernels.backends import ATTENTION_BACKENDS
from compiled_engine.model_loader.model_config import FULL_ATTENTION, SUPPORTED_DTYPES, ModelConfig

MODEL_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    model_type="llama",
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=16,
    hidden_size=64,
    vocab_size=384,
    max_position_embeddings=512,
    dtype=torch.bfloat16,
    eos_token_ids=frozenset({2}),
    bos_token_id=1,
    sliding_windows=(FULL_ATTENTION, FULL_ATTENTION),
)
CPU = torch.device("cpu")
# Options of the CLI's commands that are not the engine's (per-request sampling, logging).
COMMAND_ONLY = {"help", "prompts", "max_tokens", "temperature", "top_k", "top_p", "sampling_seed", "n"}
COMMAND_ONLY |= {"logprobs", "verbose"}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive int, got 0"),
        ({"max_num_seqs": True}, "max_num_seqs must be a positive int, got True"),
        ({"block_size": -4}, "block_size must be a positive int, got -4"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive int, got 0"),
        ({"max_model_len": 0}, "max_model_len must be a positive int, got 0"),
        ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens must be a positive int, got 2.5"),
        ({"num_kv_blocks": 0}, "num_kv_blocks must be a positive int, got 0"),
        ({"kv_cache_memory": -1}, "kv_cache_memory must be a positive int, got -1"),
        ({"seed": "7"}, "seed must be an int, got '7'"),
        ({"async_scheduling": "yes"}, "async_scheduling must be None, True or False, got 'yes'"),
        ({"async_scheduling": 1}, "async_scheduling must be None, True or False, got 1"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False, got 'no'"),
        ({"fuse_linears": 0}, "fuse_linears must be True or False, got 0"),
        ({"enforce_eager": None}, "enforce_eager must be True or False, got None"),
        ({"cpu_reserved_cores": -1}, "cpu_reserved_cores must be an int >= 0 (or None: auto), got -1"),
        ({"cpu_reserved_cores": True}, "cpu_reserved_cores must be an int >= 0 (or None: auto), got True"),
        ({"cpu_reserved_cores": 1.5}, "cpu_reserved_cores must be an int >= 0 (or None: auto), got 1.5"),
        ({"max_cpu_plan_tokens": -1}, "max_cpu_plan_tokens must be an int >= 0, got -1"),
        ({"max_cpu_plan_tokens": False}, "max_cpu_plan_tokens must be an int >= 0, got False"),
        ({"max_cpu_plan_tokens": "16"}, "max_cpu_plan_tokens must be an int >= 0, got '16'"),
        ({"attention_backend": "fast"}, "unknown attention_backend 'fast': choose one of auto, torch"),
        (
            {"tensor_parallel_size": 2, "async_scheduling": True},
            "async_scheduling=True is not supported with tensor_parallel_size > 1",
        ),
        (
            {"compile_policy": "lazy"},
            "unknown compile_policy 'lazy': choose one of background, blocking, ahead",
        ),
        (
            {"tensor_parallel_size": 2, "compile_policy": "background"},
            "compile_policy='background' is not supported with tensor_parallel_size > 1",
        ),
    ],
)
def test_a_bad_option_is_refused_on_construction_naming_it(kwargs, message):
    with pytest.raises(ValueError) as info:
        EngineArgs(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"port": 70000}, "port must be an int from 0 to 65535, got 70000"),
        ({"max_request_bytes": 0}, "max_request_bytes must be a positive int, got 0"),
        ({"served_model_name": ()}, "served_model_name must name at least one model"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive int, got 0"),  # the engine's checks too
    ],
)
def test_a_bad_server_option_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_args_are_frozen_normalised_and_picklable():
    args = EngineArgs(compile_buckets=[4, 1], device=torch.device("cpu"), async_scheduling=False)
    assert args.compile_buckets == (4, 1) and args.device == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.max_num_seqs = 3  # type: ignore[misc]
    # What rank 0 sends each tensor-parallel worker.
    assert pickle.loads(pickle.dumps(args)) == args


def test_unknown_or_positional_options_are_type_errors(llama_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineArgs(max_num_seq=4)
    with pytest.raises(TypeError):
        EngineArgs("model-dir")  # keyword only: a positional would bind by accident of order
    # LLM names the unknown keyword before loading anything.
    with pytest.raises(TypeError, match="LLM\\(\\) got an unexpected keyword argument 'max_num_seq'"):
        LLM(llama_dir, max_num_seq=4)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int, got 0"):
        LLM(llama_dir, max_num_seqs=0)


def test_llm_keywords_are_engine_args_fields_with_the_same_defaults():
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    params = inspect.signature(LLM.__init__).parameters
    named = [p for p in params.values() if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"]
    assert named, "LLM names its common options, as vLLM does"
    for param in named:
        assert param.name in fields, param.name
        assert param.default == fields[param.name].default, param.name


def test_choices_match_what_the_engine_accepts():
    assert ATTENTION_BACKEND_CHOICES == ATTENTION_BACKENDS
    assert set(DTYPE_CHOICES) == {"auto", *SUPPORTED_DTYPES}
    assert COMPILE_POLICY_CHOICES == COMPILE_POLICIES


def _command(name: str):
    parser = cli._build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return sub.choices[name]


@pytest.mark.parametrize(
    "command,cls,without",
    [
        ("generate", EngineArgs, set()),
        ("warmup", EngineArgs, {"enforce_eager", "compile_policy"}),  # warm-up builds every graph itself
        ("serve", ServerArgs, set()),
    ],
)
def test_every_field_has_a_flag_and_every_flag_is_a_field(command, cls, without):
    dests = {action.dest for action in _command(command)._actions}
    fields = {f.name for f in dataclasses.fields(cls)}
    assert fields - without <= dests, f"fields without a flag: {fields - without - dests}"
    assert not (without & dests)
    assert dests - fields <= COMMAND_ONLY, f"flags that are no option: {dests - fields - COMMAND_ONLY}"
    for f in dataclasses.fields(cls):
        assert f.metadata["flag"].help, f"{f.name} has no help text"


def test_the_cli_defaults_are_the_api_defaults():
    assert EngineArgs.from_cli_args(_command("generate").parse_args(["hi"])) == EngineArgs()
    assert EngineArgs.from_cli_args(_command("warmup").parse_args([])) == EngineArgs()
    assert ServerArgs.from_cli_args(_command("serve").parse_args([])) == ServerArgs()


def test_flags_reach_their_fields():
    argv = [
        "--model", "m", "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "3",
        "--max-num-batched-tokens", "48", "--block-size", "8", "--num-kv-blocks", "9",
        "--kv-cache-memory", "4096", "--engine-seed", "5", "--device", "cpu", "--enforce-eager",
        "--buckets", "1,2,8", "--no-fuse-linears", "--cache-dir", "/tmp/c", "--async-scheduling", "on",
        "--attention-backend", "torch", "--no-prefix-caching", "--tensor-parallel-size", "1",
        "--host", "0.0.0.0", "--port", "0", "--api-key", "k", "--served-model-name", "a", "b",
        "--max-request-bytes", "100",
    ]  # fmt: skip
    args = ServerArgs.from_cli_args(_command("serve").parse_args(argv))
    assert args == ServerArgs(
        model="m", dtype="float32", max_model_len=64, max_num_seqs=3, max_num_batched_tokens=48,
        block_size=8, num_kv_blocks=9, kv_cache_memory=4096, seed=5, device="cpu", enforce_eager=True,
        compile_buckets=(1, 2, 8), fuse_linears=False, cache_dir="/tmp/c", async_scheduling=True,
        attention_backend="torch", enable_prefix_caching=False, tensor_parallel_size=1,
        host="0.0.0.0", port=0, api_key="k", served_model_name=("a", "b"), max_request_bytes=100,
    )  # fmt: skip
    # The engine (and its workers) never see the server's options.
    assert args.engine_args() == EngineArgs(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)}
    )
    assert type(args.engine_args()) is EngineArgs
    assert args.served_model_names() == ("a", "b")
    assert ServerArgs().served_model_names() == ("default",)
    assert ServerArgs(model="/x/y").served_model_names() == ("/x/y",)
    # `generate --seed` stays the per-request sampling seed.
    namespace = _command("generate").parse_args(["hi", "--seed", "11", "--async-scheduling", "off"])
    assert namespace.sampling_seed == 11
    assert EngineArgs.from_cli_args(namespace) == EngineArgs(async_scheduling=False)


def test_the_cli_rejects_a_bad_value_with_one_clear_line(capsys):
    # Refused by EngineArgs before any model is read.
    assert cli.main(["generate", "--max-num-seqs", "0", "--model", "/nonexistent", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "compiled-engine: error: max_num_seqs must be a positive int, got 0"
    # Refused by the parser: not a choice, not an int list.
    for argv in (["warmup", "--async-scheduling", "maybe"], ["warmup", "--buckets", "1,x"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'maybe'" in err and "expected comma-separated integers, got '1,x'" in err


def test_create_engine_config_resolves_against_the_device_and_the_model(tmp_path):
    config = EngineArgs(model=str(tmp_path)).create_engine_config(CPU, MODEL_CONFIG)
    assert config.model_dir == str(tmp_path)
    assert config.dtype == torch.bfloat16  # the model's
    assert config.max_model_len == MODEL_CONFIG.max_position_embeddings
    assert config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert config.compile_buckets == default_buckets(DEFAULT_MAX_NUM_BATCHED_TOKENS, 256)
    assert config.async_scheduling is False  # CPU's default
    assert config.num_kv_blocks_override is None and config.kv_cache_memory is None
    cuda = EngineArgs().create_engine_config(torch.device("cuda", 1), MODEL_CONFIG)
    assert cuda.async_scheduling is True and cuda.device == torch.device("cuda", 1)
    assert cuda.model_dir  # no model: the embedded one
    tp = EngineArgs(tensor_parallel_size=2).create_engine_config(torch.device("cuda", 0), MODEL_CONFIG)
    assert tp.async_scheduling is False  # every rank runs the synchronous loop
    given = EngineArgs(compile_buckets=[8, 2], max_num_batched_tokens=8, num_kv_blocks=7, max_model_len=100)
    resolved = given.create_engine_config(CPU, MODEL_CONFIG)
    assert resolved.compile_buckets == (2, 8)  # ascending
    assert (resolved.num_kv_blocks_override, resolved.max_model_len) == (7, 100)
    eager = EngineArgs(enforce_eager=True, compile_buckets=[0]).create_engine_config(CPU, MODEL_CONFIG)
    assert eager.compile_buckets == ()  # nothing is compiled, so nothing is checked


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_model_len": 513}, "max_model_len=513 exceeds the model's max_position_embeddings=512"),
        ({"compile_buckets": [0]}, "buckets must be positive ints, got 0"),
        ({"compile_buckets": [4096]}, "bucket 4096 exceeds max_num_batched_tokens=2048"),
    ],
)
def test_what_depends_on_the_model_is_checked_when_resolving(kwargs, message):
    args = EngineArgs(**kwargs)
    with pytest.raises(ValueError, match=message):
        args.create_engine_config(CPU, MODEL_CONFIG)


def test_the_compile_policy_resolves_from_the_option_the_environment_and_the_device(monkeypatch):
    monkeypatch.delenv("COMPILED_ENGINE_COMPILE_POLICY", raising=False)
    assert EngineArgs().create_engine_config(CPU, MODEL_CONFIG).compile_policy == "background"
    assert EngineArgs().create_engine_config(torch.device("cuda"), MODEL_CONFIG).compile_policy == "blocking"
    monkeypatch.setenv("COMPILED_ENGINE_COMPILE_POLICY", "ahead")
    assert EngineArgs().create_engine_config(CPU, MODEL_CONFIG).compile_policy == "ahead"
    explicit = EngineArgs(compile_policy="blocking").create_engine_config(CPU, MODEL_CONFIG)
    assert explicit.compile_policy == "blocking"  # the option wins over the environment
    monkeypatch.setenv("COMPILED_ENGINE_COMPILE_POLICY", "background")
    tp = EngineArgs(tensor_parallel_size=2).create_engine_config(CPU, MODEL_CONFIG)
    assert tp.compile_policy == "blocking"  # the environment's default cannot pick it for ranks
    monkeypatch.setenv("COMPILED_ENGINE_COMPILE_POLICY", "sometimes")
    with pytest.raises(
        ValueError, match="COMPILED_ENGINE_COMPILE_POLICY='sometimes' is not a compile policy"
    ):
        EngineArgs().create_engine_config(CPU, MODEL_CONFIG)
    with pytest.raises(
        ValueError, match="compile_policy='background' runs on the CPU only for now, not on cuda"
    ):
        EngineArgs(compile_policy="background").create_engine_config(torch.device("cuda"), MODEL_CONFIG)
