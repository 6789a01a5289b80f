"""How the attention_backend setting resolves to an op, and the errors when it cannot."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

import compiled_engine.kernels  # noqa: F401  (registers the ops)
from compiled_engine.kernels.backends import (
    ATTENTION_BACKENDS,
    AttentionBackendUnavailableError,
    resolve_attention_backend,
)
from compiled_engine.kernels.paged_attention import PAGED_ATTENTION_VERSION
from compiled_engine.kernels.reference import REFERENCE_VERSION

CPU = torch.device("cpu")
# Resolution never touches the device, so CUDA rules can be checked on a machine without one.
CUDA = torch.device("cuda")

needs_triton = pytest.mark.skipif(
    not compiled_engine.kernels.TRITON_AVAILABLE, reason="needs the triton package (Linux x86_64)"
)


@pytest.fixture
def no_flashinfer(monkeypatch):
    # A None entry makes `import flashinfer` raise ImportError, installed or not.
    monkeypatch.setitem(sys.modules, "flashinfer", None)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown attention_backend 'cutlass'") as error:
        resolve_attention_backend("cutlass", CPU)
    for name in ATTENTION_BACKENDS:
        assert name in str(error.value)


def test_torch_backend_is_the_reference_op():
    backend = resolve_attention_backend("torch", CPU)
    assert backend.name == "torch"
    assert backend.op is torch.ops.compiled_engine.paged_attention
    assert backend.version == f"{PAGED_ATTENTION_VERSION}+{REFERENCE_VERSION}"
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend.name = "triton"


def test_auto_on_cpu_is_never_triton_even_when_triton_could_interpret(monkeypatch):
    # The cpu kernel where it builds (tests/test_cpu_attention.py covers the fallback), else torch.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("auto", CPU).name in ("cpu", "torch")
    assert resolve_attention_backend("auto", "cpu").name == resolve_attention_backend("auto", CPU).name


@needs_triton
def test_auto_on_cuda_prefers_triton(no_flashinfer):
    backend = resolve_attention_backend("auto", CUDA)
    assert backend.name == "triton"
    assert backend.op is torch.ops.compiled_engine.paged_attention_triton


@needs_triton
def test_auto_passes_over_flashinfer_until_it_is_wired(fake_flashinfer):
    assert resolve_attention_backend("auto", CUDA).name == "triton"


def test_auto_on_cuda_without_triton_is_torch(no_flashinfer, no_triton):
    assert resolve_attention_backend("auto", CUDA).name == "torch"


@needs_triton
def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AttentionBackendUnavailableError, match="on CPU runs only under TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(AttentionBackendUnavailableError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", CPU)


@needs_triton
def test_triton_on_cpu_with_the_interpreter(monkeypatch):
    import triton

    from compiled_engine.kernels.triton_attention import TRITON_ATTENTION_VERSION

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = resolve_attention_backend("triton", CPU)
    assert backend.name == "triton"
    assert backend.op is torch.ops.compiled_engine.paged_attention_triton
    assert backend.version == f"{TRITON_ATTENTION_VERSION}+triton-{triton.__version__}"


@needs_triton
def test_triton_on_cuda():
    assert resolve_attention_backend("triton", CUDA).name == "triton"


@needs_triton
def test_triton_on_another_device_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(AttentionBackendUnavailableError, match="needs a CUDA device, got mps"):
        resolve_attention_backend("triton", torch.device("mps"))


@pytest.mark.parametrize("device", [CPU, CUDA], ids=["cpu", "cuda"])
def test_triton_without_the_package(no_triton, device):
    with pytest.raises(
        AttentionBackendUnavailableError, match=r"needs the triton package \(pip install triton\)"
    ):
        resolve_attention_backend("triton", device)


def test_flashinfer_without_the_package(no_flashinfer):
    with pytest.raises(AttentionBackendUnavailableError) as error:
        resolve_attention_backend("flashinfer", CUDA)
    message = str(error.value)
    assert "needs a CUDA device and flashinfer-python" in message
    assert "pip install 'compiled-engine[flashinfer]'" in message
    assert "flashinfer is not importable" in message and "the device is" not in message


def test_flashinfer_on_cpu(fake_flashinfer):
    with pytest.raises(AttentionBackendUnavailableError, match="the device is cpu") as error:
        resolve_attention_backend("flashinfer", CPU)
    assert "not importable" not in str(error.value)


def test_flashinfer_available_is_not_wired_yet(fake_flashinfer):
    with pytest.raises(NotImplementedError, match="flashinfer backend is not wired yet"):
        resolve_attention_backend("flashinfer", CUDA)
