"""The on-disk compile cache: manifests, safe files, warm starts without tracing, rebuilds."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.graphs.compile_cache import CompileCache, atomic_write
from compiled_engine.graphs.compile_manifest import GraphOptions, build_manifest, diff_fields, manifest_key
from compiled_engine.graphs.compiled_step import step_component_versions
from compiled_engine.graphs.constant_recipes import build_constants, lifted_constant_names, recipe_of
from compiled_engine.model_loader.loader import load_model

BUCKETS = (1, 2, 4)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 9, 12, 3, 7]}, {"prompt_token_ids": [8, 1, 4]}]


def _options(**changes) -> GraphOptions:
    base = dict(
        dtype=torch.float32,
        block_size=16,
        buckets=BUCKETS,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_cache_shape=(2, 16, 2, 16),
        fuse_linears=True,
        attention_backend="torch",
    )
    base.update(changes)
    return GraphOptions(**base)


def _llm(model_dir: str, cache_dir, **kwargs) -> LLM:
    settings = dict(
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_kv_blocks=32,
        compile_buckets=BUCKETS,
        cache_dir=str(cache_dir),
    )
    return LLM(model_dir, **{**settings, **kwargs})


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def llama_model(llama_dir):
    return load_model(llama_dir, dtype="float32").model


def test_manifest_names_what_changed(llama_model):
    versions = step_component_versions(True)
    base = build_manifest(llama_model, _options(), torch.device("cpu"), versions)
    assert base == build_manifest(llama_model, _options(), torch.device("cpu"), versions)
    for change, field in [
        (dict(block_size=32), "engine.block_size"),
        (dict(buckets=(1, 2)), "engine.buckets"),
        (dict(dtype=torch.bfloat16), "engine.dtype"),
        (dict(fuse_linears=False), "engine.fuse_linears"),
        (dict(kv_cache_shape=(2, 16, 4, 16)), "engine.kv_cache_shape"),
        (dict(attention_backend="triton"), "engine.attention_backend"),
    ]:
        other = build_manifest(llama_model, _options(**change), torch.device("cpu"), versions)
        assert diff_fields(base, other) == [field]
        assert manifest_key(other) != manifest_key(base)
    bumped = build_manifest(llama_model, _options(), torch.device("cpu"), dict(versions, passes="x"))
    assert diff_fields(base, bumped) == ["versions.passes"]
    for field in ("versions.torch", "versions.transformers", "versions.triton", "device.capability"):
        assert base[field]


def test_manifest_covers_weights_and_config(llama_dir, llama_model):
    other = load_model(llama_dir, dtype="float32").model
    versions = step_component_versions(True)
    base = build_manifest(llama_model, _options(), torch.device("cpu"), versions)
    other.config.rms_norm_eps = 1e-3
    other.lm_head.weight = torch.nn.Parameter(other.lm_head.weight[:-1].clone())
    changed = build_manifest(other, _options(), torch.device("cpu"), versions)
    assert diff_fields(base, changed) == ["model.config_sha", "model.weights_sha"]


def test_manifest_ignores_how_the_model_path_was_spelled(llama_dir, llama_model, monkeypatch):
    # `warmup --model ./dir` and `serve --model /abs/dir` must land on one cache entry.
    monkeypatch.chdir(Path(llama_dir).parent)
    relative = load_model(Path(llama_dir).name, dtype="float32").model
    versions = step_component_versions(True)
    base = build_manifest(llama_model, _options(), torch.device("cpu"), versions)
    assert relative.config._name_or_path != llama_model.config._name_or_path
    assert diff_fields(base, build_manifest(relative, _options(), torch.device("cpu"), versions)) == []


def test_explain_miss_names_nearest_fields(tmp_path, llama_model):
    cache = CompileCache(tmp_path)
    versions = step_component_versions(True)
    first = cache.entry(build_manifest(llama_model, _options(), torch.device("cpu"), versions))
    assert "no entries yet" in first.explain_miss()
    first.ensure()
    second = cache.entry(build_manifest(llama_model, _options(block_size=32), torch.device("cpu"), versions))
    message = second.explain_miss()
    assert "1 field(s)" in message and "engine.block_size: '16' -> '32'" in message


def test_artifact_and_record_corruption_is_detected(tmp_path, caplog):
    entry = CompileCache(tmp_path).entry({"format": "1", "x": "y"})
    entry.write_artifact("bucket-1", {"bucket": 1}, b"payload" * 100)
    header, payload = entry.read_artifact("bucket-1")
    assert header["bucket"] == 1 and payload == b"payload" * 100
    path = entry.artifact_path("bucket-1")
    path.write_bytes(path.read_bytes()[:-10])  # truncated
    with caplog.at_level(logging.WARNING):
        assert entry.read_artifact("bucket-1") is None
    assert "unusable" in caplog.text and "bucket-1.artifact" in caplog.text
    assert not path.exists()  # removed, so the rebuild replaces it

    entry.write_artifact("bucket-2", {"bucket": 2}, b"abc")
    data = bytearray(entry.artifact_path("bucket-2").read_bytes())
    data[-1] ^= 1  # one flipped bit
    entry.artifact_path("bucket-2").write_bytes(bytes(data))
    assert entry.read_artifact("bucket-2") is None

    entry.write_record("step", {"sources": ["L['inputs'].input_ids"]})
    assert entry.read_record("step", ("sources",)) == {"sources": ["L['inputs'].input_ids"]}
    (entry.dir / "step.json").write_text('{"sources": [')
    assert entry.read_record("step", ("sources",)) is None
    entry.write_record("step", {"other": 1})
    assert entry.read_record("step", ("sources",)) is None


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "d" / "f.json"
    atomic_write(target, b"1")
    atomic_write(target, b"22")
    assert target.read_bytes() == b"22"
    assert [p.name for p in target.parent.iterdir()] == ["f.json"]


def test_recipes_rebuild_the_traced_constants(tmp_path, llama_dir):
    llm = _llm(llama_dir, tmp_path)
    step = llm.engine.model_runner.step_graph
    graph = step.traced.graph
    names = lifted_constant_names(graph)
    recipes = [recipe_of(graph, n) for n in names]
    assert all(r is not None for r in recipes)
    assert any(r["kind"] == "concat" for r in recipes)  # the fused q/k/v and gate/up weights
    tensors = {**dict(graph.named_parameters()), **dict(graph.named_buffers())}
    model = llm.engine.model_runner.step_graph.model
    for name, rebuilt in zip(names, build_constants(recipes, model), strict=True):
        assert torch.equal(rebuilt, tensors[name]), name
    # Frozen (not fused) weights are the model's own tensors, not copies.
    frozen = [n for n, r in zip(names, recipes, strict=True) if r["kind"] == "model"]
    rebuilt = build_constants([recipe_of(graph, n) for n in frozen], model)
    assert frozen and all(t is tensors[n] for n, t in zip(frozen, rebuilt, strict=True))


def test_warm_start_loads_without_tracing_and_matches(tmp_path, llama_dir, caplog, monkeypatch):
    cold = _llm(llama_dir, tmp_path)
    cold_step = cold.engine.model_runner.step_graph
    cold_step.compile_buckets()
    expected = _tokens(cold)
    assert cold_step.num_traces == 1
    assert {b.source for b in cold_step.builds.values()} == {"compiled"}
    assert all(b.saved for b in cold_step.builds.values())
    entry = cold.engine.model_runner.step_graph.cache_entry
    assert sorted(entry.artifact_names()) == ["bucket-1", "bucket-2", "bucket-4", "dynamic"]
    assert json.loads((entry.dir / "manifest.json").read_text()) == entry.manifest
    assert cold_step.store is not None
    if cold_step.gemv_decision().noisy:
        # A timing disturbed by other load is deliberately not cached, so the rebuild below would
        # measure again (Inductor compiles of its own); keep this run's decision so it does not.
        cold_step.store.write_gemv_decision(cold_step.gemv_decision())

    import torch._inductor.compile_fx as compile_fx_module

    inductor_compiles = []
    real_compile_fx = compile_fx_module.compile_fx
    monkeypatch.setattr(
        compile_fx_module,
        "compile_fx",
        lambda *a, **k: inductor_compiles.append(1) or real_compile_fx(*a, **k),
    )
    torch._dynamo.utils.counters.clear()
    # Another KV-cache size (as a CUDA start sizes it from free memory) is the same entry.
    warm = _llm(llama_dir, tmp_path, num_kv_blocks=48)
    warm_step = warm.engine.model_runner.step_graph
    assert _tokens(warm) == expected
    assert warm_step.num_traces == 0 and warm_step.traced is None
    assert {b.source for b in warm_step.builds.values()} == {"loaded"}
    assert set(warm_step.builds) == {1, 2, 4, None}
    # Dynamo never ran a frame and Inductor never compiled a graph in the warm engine.
    assert sum(torch._dynamo.utils.counters["frames"].values()) == 0
    assert inductor_compiles == []

    # A truncated artifact is reported, rebuilt (a trace and one compile) and saved again.
    path = entry.artifact_path("bucket-2")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING):
        rebuilt = _llm(llama_dir, tmp_path)
    assert "bucket-2.artifact is unusable" in caplog.text
    rebuilt_step = rebuilt.engine.model_runner.step_graph
    assert _tokens(rebuilt) == expected
    rebuilt_step.compile_buckets()
    assert len(inductor_compiles) == 1  # the counter above does count real compiles
    assert rebuilt_step.builds[2].source == "compiled" and rebuilt_step.builds[2].saved
    assert {b for b, r in rebuilt_step.builds.items() if r.source == "loaded"} == {1, 4, None}
    assert entry.read_artifact("bucket-2") is not None


def test_other_options_miss_and_say_why(tmp_path, llama_dir, caplog):
    _llm(llama_dir, tmp_path)
    with caplog.at_level(logging.INFO, logger="compiled_engine.graphs.step_graph"):
        other = _llm(llama_dir, tmp_path, fuse_linears=False)
    assert "engine.fuse_linears: 'True' -> 'False'" in caplog.text
    assert other.engine.model_runner.step_graph.num_traces == 1


def test_packed_linear_buckets_save_and_load(tmp_path, llama_dir, monkeypatch):
    """Graphs whose linears run through oneDNN (graphs/passes/onednn_linear.py) save and load like
    any other: the artifact takes the plain weights, and the op packs them again on first use."""
    from compiled_engine.graphs.compiled_step import CompiledStep
    from compiled_engine.graphs.gemv_policy import GemvDecision
    from compiled_engine.kernels.onednn_linear import onednn_linear_available

    if not onednn_linear_available(torch.float32):
        pytest.skip("this torch has no oneDNN (mkldnn) on CPU")
    # (Greedy parity of packed graphs with transformers: tests/test_compiled_parity.py.)
    packed = GemvDecision((), packed_rows=BUCKETS, packs_dynamic=True)
    monkeypatch.setattr(CompiledStep, "gemv_decision", lambda step: packed)
    cold = _llm(llama_dir, tmp_path)
    cold.engine.model_runner.step_graph.compile_buckets()
    cold_builds = cold.engine.model_runner.step_graph.builds
    assert all(b.variant.packed_linears and b.saved for b in cold_builds.values())
    expected = _tokens(cold)

    warm = _llm(llama_dir, tmp_path)
    warm_step = warm.engine.model_runner.step_graph
    assert warm_step.num_traces == 0
    assert {b.source for b in warm_step.builds.values()} == {"loaded"}
    assert all(b.variant.packed_linears for b in warm_step.builds.values())
    # A loaded bucket reports the passes its graph got when compiled (stored in the artifact header).
    assert {b: r.passes for b, r in warm_step.builds.items()} == {b: r.passes for b, r in cold_builds.items()}
    assert _tokens(warm) == expected
