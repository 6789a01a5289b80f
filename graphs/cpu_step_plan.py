"""CPU step plans: a compiled bucket's call recorded once, then replayed from C++ (#19).

On CUDA a decode bucket is captured as a CUDA graph, and a replay runs no Python. On the CPU a
compiled bucket is Inductor's Python wrapper (`call` in its generated module): for every layer
it allocates a few buffers, calls ~4 fused C++ kernels through their Python bindings and ~5 of
our ops through the dispatcher, and makes ~10 views. At one request that wrapper is 15-20 % of
the whole decode step (`python -m bench.step_profile --seqs 1`: 0.40 of 2.25 ms on bench-small,
1.76 of 14.8 ms on the 24-layer Qwen2.5-0.5B shape), and no faster kernel removes it.

`record_step_plan(fn)` runs `fn` (a bucket's artifact bound to fixed buffers: graphs/decode_graphs.py)
with the wrapper's kernels and ops swapped for recorders, and hands each call, in order, to
kernels/cpu_ops.cpp's `CpuStepPlan`: a fused kernel as its C function's address and its
arguments (tensors become their data pointers), an op as its tensors and scalars, writing into
the output tensor the recorded call returned. The plan keeps every tensor the calls touched
alive, so each replay computes on the same memory; `CpuStepPlan.run` makes the calls from C++.

A recording is refused (the caller keeps calling `fn`), with the reason, unless:

- the native ops library is loaded (kernels/cpu_ops.py) and `fn` ran exactly one Inductor wrapper;
- every statement of that wrapper is of a form this file knows (`_check_wrapper`): buffer
  allocations and views, aliases, `del`, fused-kernel calls, `torch.ops.compiled_engine` op
  calls, stride reads and the return. Anything else (a Python-level op, an `aten` or extern kernel
  call, a loop) may compute something the plan would not repeat;
- fused kernels take only tensors and ints, and every op is one `CpuStepPlan.add_op` knows;
- the output is a view of memory the plan holds, and replaying the plan once, right after
  recording, gives the recorded output bit for bit (a decode step can run twice: it writes the
  same keys and values to the same slots).
"""

from __future__ import annotations

import ast
import ctypes
import inspect
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, NamedTuple

import torch

from compiled_engine.graphs.step_inputs import StepInputs
from compiled_engine.kernels import cpu_ops

# Names the wrapper may call besides its fused kernels and `torch.ops.compiled_engine` ops:
# allocations and views (their memory is then held by the plan) and checks that compute nothing.
_SAFE_CALLS = frozenset({"empty_strided_cpu", "reinterpret_tensor", "assert_size_stride", "assert_alignment"})
# Inductor's extern GEMMs (`extern_kernels.mm(a, b, out=buf)`: a linear the lowering left to torch),
# replayed as ATen's out= variants.
_EXTERN_GEMMS = frozenset({"mm", "addmm", "bmm"})


class RunDraws(NamedTuple):
    """How a multi-step run's sampling rows draw (`CpuStepPlan.decode_on`): kernels/cpu_sampler.cpp's
    ce_cpu_temperature_draw by address, each row's greedy flag (bool [rows]: those keep the argmax)
    and temperature (float32 [rows]), and one uniform number per step and row (float32 [steps, rows])."""

    kernel: int
    greedy: torch.Tensor
    temperature: torch.Tensor
    uniform: torch.Tensor


class StepPlanRefused(Exception):
    """A recorded call the plan cannot replay; the message says which and why."""


@dataclass
class CpuStepPlan:
    """A recorded step: `replay()` makes its calls again and returns the same output tensor,
    overwritten (valid until the next replay, as a CUDA graph's output)."""

    plan: Any  # torch.classes.compiled_engine.CpuStepPlan
    output: torch.Tensor
    keep: list[torch.Tensor] = field(repr=False)  # every tensor the calls read or write
    num_calls: int = 0
    # What each call is, in order: a fused kernel's name in the wrapper (`cpp_fused_...`), an
    # op's qualified name (`compiled_engine::cpu_gemv`) or an extern GEMM's (`aten::mm`).
    labels: tuple[str, ...] = ()

    def replay(self) -> torch.Tensor:
        self.plan.run()
        return self.output

    def decode_on(
        self,
        greedy_kernel: int,
        tokens: torch.Tensor,
        inputs: StepInputs,
        block_size: int,
        draw: RunDraws | None = None,
    ) -> None:
        """Multi-step runs: fill `tokens` ([steps + 1, rows] int64, its first row the tokens of the
        step just replayed) with `steps` more decode steps of its rows, each fed the tokens the one
        before picked (kernels/cpu_ops.cpp's CpuStepPlan.decode_on). `inputs` are the step's views
        of the buffers this plan reads; `greedy_kernel` the address of kernels/cpu_sampler.cpp's
        ce_cpu_greedy; `draw`, where some rows sample with a temperature, how they draw."""
        rows = tokens.shape[1]
        empty = torch.empty(0)
        kernel, greedy, temperature, uniform = (0, empty, empty, empty) if draw is None else draw
        self.plan.decode_on(
            greedy_kernel, kernel, greedy, temperature, uniform, tokens, inputs.input_ids[0],
            inputs.positions, inputs.seq_lens, inputs.slot_mapping, inputs.block_tables, block_size,
            self.output[:rows],
        )  # fmt: skip

    def time_calls(self, on: bool = True) -> None:
        """Start (or stop) timing each call of the replays that follow; the counts start at 0."""
        self.plan.set_timed(on)

    def take_call_times(self) -> PlanCallTimes:
        """The timed replays since the last take (or `time_calls`), each call's summed seconds."""
        runs, *nanoseconds = self.plan.take_times()
        return PlanCallTimes(int(runs), tuple(zip(self.labels, (n / 1e9 for n in nanoseconds), strict=True)))


@dataclass(frozen=True)
class PlanCallTimes:
    """Where timed replays of a plan spent their time (bench/step_profile.py reads it)."""

    replays: int
    calls: tuple[tuple[str, float], ...]  # (label, seconds over all the replays) per call, in order


def record_step_plan(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, CpuStepPlan | None, str | None]:
    """Run `fn` (more than once: it must be repeatable) and record it.

    Returns its output, and a plan replaying it or None with the reason it was refused.
    """
    if cpu_ops.use_native_ops() is not None:
        return fn(), None, "the C++ CPU ops are not loaded (kernels/cpu_ops.py)"
    output, wrappers = _run_finding_wrappers(fn)
    if len(wrappers) != 1:
        return output, None, f"the step ran {len(wrappers)} Inductor wrappers, not one"
    namespace, code = wrappers[0]
    try:
        kernels = _check_wrapper(code, namespace)
        calls, output = _run_recording(fn, namespace, kernels)
        plan = _build(calls, output)
        expected = output.clone()
        replayed = plan.replay()
    except StepPlanRefused as exc:
        return output, None, str(exc)
    except Exception as exc:  # noqa: BLE001 - fn ran once without error: the recorder is at fault
        return output, None, f"recording failed: {type(exc).__name__}: {exc}"
    if not torch.equal(replayed.isnan(), expected.isnan()) or not torch.equal(
        replayed.nan_to_num(), expected.nan_to_num()
    ):
        return expected, None, "a replay right after recording did not give the recorded output"
    return replayed, plan, None


# -- finding and checking the wrapper ------------------------------------------------------------


def _run_finding_wrappers(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[tuple[dict, CodeType]]]:
    """`fn()`, and the (module namespace, code) of each Inductor wrapper `call` it ran."""
    found: list[tuple[dict, CodeType]] = []

    def profile(frame: Any, event: str, _arg: object) -> None:
        if event != "call" or frame.f_code.co_name != "call":
            return
        namespace = frame.f_globals
        if "reinterpret_tensor" in namespace and "empty_strided_cpu" in namespace:
            if all(namespace is not seen for seen, _ in found):
                found.append((namespace, frame.f_code))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        output = fn()
    finally:
        sys.setprofile(previous)
    return output, found


def _is_kernel(value: object) -> bool:
    """A fused kernel's Python binding: the `kernel` builtin of a compiled extension module."""
    module = getattr(value, "__self__", None)
    return (
        type(value).__name__ == "builtin_function_or_method"
        and getattr(value, "__name__", None) == "kernel"
        and str(getattr(module, "__file__", "")).endswith(".so")
    )


def _dotted(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _check_wrapper(code: CodeType, namespace: dict) -> set[str]:
    """The names of the wrapper's fused kernels; raises StepPlanRefused at a statement the plan
    could not repeat."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise StepPlanRefused(f"the wrapper's source cannot be read: {exc}") from exc
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef):
        raise StepPlanRefused("the wrapper's source is not a function")
    kernels = {name for name, value in namespace.items() if _is_kernel(value)}
    for statement in function.body:
        if not isinstance(statement, (ast.Assign, ast.Expr, ast.Delete, ast.Return)):
            kind = type(statement).__name__
            raise StepPlanRefused(f"the wrapper has a {kind} statement: {ast.unparse(statement)}")
        for node in ast.walk(statement):
            if isinstance(node, ast.Call) and not _known_call(node, kernels):
                raise StepPlanRefused(f"the wrapper calls {ast.unparse(node.func)}: {ast.unparse(statement)}")
    return kernels


def _known_call(call: ast.Call, kernels: set[str]) -> bool:
    name = _dotted(call.func)
    if name is None:
        return False
    if name in kernels or name in _SAFE_CALLS or name == "args.clear":
        return True
    parts = name.split(".")
    if len(parts) == 2 and parts[0] == "extern_kernels" and parts[1] in _EXTERN_GEMMS:
        return True
    if parts[:3] == ["torch", "ops", "compiled_engine"] and len(parts) == 5:
        return True
    return len(parts) == 2 and parts[1] == "stride" and not call.args  # a size read, e.g. arg45_1.stride()


# -- recording -----------------------------------------------------------------------------------


@dataclass
class _KernelCall:
    name: str  # the kernel's name in the wrapper
    binding: Any
    args: tuple


@dataclass
class _OpCall:
    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    result: object


@dataclass
class _GemmCall:
    name: str
    args: tuple
    kwargs: dict


class _RecordingGemms:
    """Stands in for the wrapper's `extern_kernels` global: its GEMMs run and are recorded."""

    def __init__(self, real: Any, calls: list) -> None:
        self._real = real
        self._calls = calls

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in _EXTERN_GEMMS:
            raise StepPlanRefused(f"the wrapper calls extern_kernels.{name}")
        gemm = getattr(self._real, name)
        calls = self._calls

        def record(*args: Any, **kwargs: Any) -> Any:
            result = gemm(*args, **kwargs)
            calls.append(_GemmCall(name, args, kwargs))
            return result

        return record


class _RecordingOps:
    """Stands in for the wrapper's `torch` global: `torch.ops.compiled_engine.<op>.<overload>(...)`
    runs the op and records the call; every other attribute is torch's own."""

    def __init__(self, calls: list) -> None:
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        if name != "ops":
            return getattr(torch, name)
        calls = self._calls

        class Overload:
            def __init__(self, op: torch._ops.OpOverload) -> None:
                self.op = op

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                result = self.op(*args, **kwargs)
                calls.append(_OpCall(self.op, args, kwargs, result))
                return result

        class Packet:
            def __init__(self, packet: Any) -> None:
                self.packet = packet

            def __getattr__(self, overload: str) -> Overload:
                return Overload(getattr(self.packet, overload))

        class Namespace:
            def __init__(self, namespace: str) -> None:
                if namespace != "compiled_engine":
                    raise StepPlanRefused(f"the wrapper calls a torch.ops.{namespace} op")
                self.namespace = getattr(torch.ops, namespace)

            def __getattr__(self, op: str) -> Packet:
                return Packet(getattr(self.namespace, op))

        class Ops:
            def __getattr__(self, namespace: str) -> Namespace:
                return Namespace(namespace)

        return Ops()


def _run_recording(
    fn: Callable[[], torch.Tensor], namespace: dict, kernels: set[str]
) -> tuple[list, torch.Tensor]:
    """`fn()` with the wrapper's kernels and ops recording; the calls in order, and the output."""
    calls: list = []

    def recorder(name: str, binding: Any) -> Callable[..., None]:
        def record(*args: Any) -> None:
            binding(*args)
            calls.append(_KernelCall(name, binding, args))

        return record

    swapped = {name: namespace[name] for name in (*kernels, "torch", "extern_kernels") if name in namespace}
    for name in kernels:
        namespace[name] = recorder(name, swapped[name])
    namespace["torch"] = _RecordingOps(calls)
    if "extern_kernels" in swapped:
        namespace["extern_kernels"] = _RecordingGemms(swapped["extern_kernels"], calls)
    try:
        output = fn()
    finally:
        namespace.update(swapped)
    return calls, output


# -- building the plan ---------------------------------------------------------------------------

_LIBRARIES: dict[str, ctypes.CDLL] = {}


def _kernel_address(binding: Any) -> int:
    path = binding.__self__.__file__
    library = _LIBRARIES.get(path)
    if library is None:
        library = _LIBRARIES[path] = ctypes.CDLL(path)  # the loaded module's own handle
    address = ctypes.cast(library.kernel, ctypes.c_void_p).value
    if not address:
        raise StepPlanRefused(f"no kernel symbol in {path}")
    return address


def _build(calls: list, output: torch.Tensor) -> CpuStepPlan:
    plan = torch.classes.compiled_engine.CpuStepPlan()
    keep: list[torch.Tensor] = []
    labels: list[str] = []
    for call in calls:
        if isinstance(call, _KernelCall):
            labels.append(call.name)
            args = []
            for arg in call.args:
                if isinstance(arg, torch.Tensor):
                    keep.append(arg)
                    args.append(arg.data_ptr())
                elif isinstance(arg, int) and not isinstance(arg, bool):
                    args.append(arg)
                else:
                    raise StepPlanRefused(f"a fused kernel takes a {type(arg).__name__} argument")
            plan.add_kernel(_kernel_address(call.binding), args)
        elif isinstance(call, _GemmCall):
            name, tensors, floats, out = _gemm_arguments(call)
            labels.append(f"aten::{name}")
            keep.extend((*tensors, out))
            if not plan.add_op(name, tensors, floats, [], out):
                raise StepPlanRefused(f"the plan does not replay extern_kernels.{name}")
        else:
            tensors, floats, ints = _op_arguments(call)
            result = call.result
            if not isinstance(result, torch.Tensor) or not result.is_contiguous():
                raise StepPlanRefused(f"{call.op} returned no contiguous tensor")
            keep.extend(tensors)
            keep.append(result)
            labels.append(call.op._schema.name)
            if not plan.add_op(call.op._schema.name.split("::")[-1], tensors, floats, ints, result):
                raise StepPlanRefused(f"the plan does not replay {call.op}")
    held = {t.untyped_storage().data_ptr() for t in keep}
    if output.untyped_storage().data_ptr() not in held:
        raise StepPlanRefused("the step's output is not memory the recorded calls write")
    return CpuStepPlan(plan, output, keep, num_calls=len(calls), labels=tuple(labels))


def _op_arguments(call: _OpCall) -> tuple[list[torch.Tensor], list[float], list[int]]:
    """The op's tensors, floats and ints, each in schema order (an absent optional tensor left out)."""
    tensors: list[torch.Tensor] = []
    floats: list[float] = []
    ints: list[int] = []
    for i, argument in enumerate(call.op._schema.arguments):
        if i < len(call.args):
            value = call.args[i]
        elif argument.name in call.kwargs:
            value = call.kwargs[argument.name]
        elif argument.has_default_value():
            value = argument.default_value
        else:
            raise StepPlanRefused(f"{call.op} was called without {argument.name}")
        kind = str(argument.type)
        if value is None and isinstance(argument.type, torch.OptionalType):
            continue
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif kind == "float":
            floats.append(float(value))
        elif kind == "int":
            ints.append(int(value))
        else:
            raise StepPlanRefused(f"{call.op} takes a {kind} argument ({argument.name})")
    return tensors, floats, ints


def _gemm_arguments(call: _GemmCall) -> tuple[str, list[torch.Tensor], list[float], torch.Tensor]:
    """An extern GEMM's name, tensors, (beta, alpha) for addmm, and out."""
    out = call.kwargs.get("out")
    tensors = list(call.args)
    expected = 3 if call.name == "addmm" else 2
    unknown = set(call.kwargs) - {"out", "alpha", "beta"}
    if not isinstance(out, torch.Tensor) or len(tensors) != expected or unknown:
        raise StepPlanRefused(f"extern_kernels.{call.name} called without out= or with other arguments")
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise StepPlanRefused(f"extern_kernels.{call.name} takes a non-tensor argument")
    floats = []
    if call.name == "addmm":
        floats = [float(call.kwargs.get("beta", 1)), float(call.kwargs.get("alpha", 1))]
    return call.name, tensors, floats, out
