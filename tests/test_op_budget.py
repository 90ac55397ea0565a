"""How many tensor ops one synchronized training call issues: a budget, not a timing.

On a GPU each op is a kernel launch and each costs host time, which decides small layers
(issue 19: host time per call). These counts are taken under a ``TorchDispatchMode`` (every
aten call that reaches the backend, after autograd), on the CPU, with the collective
replaced by the one-process reducer, so they depend on syncbn's code and not on the machine.
Kernels (ops that are neither views nor bare allocations: on a GPU, launches; a
``torch.cat`` of mixed dtypes counts one per input, as CUDA copies them one by one) are
budgeted apart from all calls. A change that adds ops to every call fails here and must
raise the budget on purpose. Measured with torch 2.13, running statistics tracked (calls /
kernels): forward 45 / 36 and backward 15 / 10 unmasked; forward 60 / 42 and backward 27 /
16 masked, its valid count read back to the host and its first position found valid (no
search), as a CPU call with immediate checks does (3 / 2 more where it searches); with the
checks deferred, as on accelerators, forward 59 / 41 and backward 15 / 10 unmasked, 82 / 51
and 27 / 16 masked (the count and position stay on the device; on an accelerator an
unmasked forward fills its count on the device, 1 kernel more: ``_protocol.pack_forward``);
bfloat16 input with float32 parameters, forward 43 / 35 and backward 17 / 12 (its output is
an eval-mode ``batch_norm``, which takes no offset; its input gradient is summed in float32
and rounded once, as torch's: the input converted to float32, the output gradient promoted
inside the float32 ``addcmul_``, the result converted back; 16 / 11 before 2026-12-06, when
one conversion of the scale to bfloat16 rounded it twice, and 18 / 13 until 2026-12-08,
when the output gradient was converted on its own). A host read (``_local_scalar_dense``)
counts as a kernel. Kernels are budgeted 1 over these counts, calls 2 over (torch 2.1-2.7
count 1 more in one direction or the other). The shift of the local sums, a median of 9
values (``sample_shift``: two ``minimum``, two ``maximum`` and two ``clamp``, and their
views), costs 8 calls and 6 kernels forward (11 / 7 masked, which first replaces the padded
ones); it was one strided view of the first value before, which an outlier made cancel.
Since 2026-12-07, 3 kernels more forward (4 deferred), for the non-finite input that torch's
batch norm keeps infinite in its running mean: a shift that is not finite becomes 0
(``nan_to_num_``), and each running statistic moves as ``target * factor + running * (1 -
factor)``, a product and a sum, where one ``lerp`` made an infinite one NaN (deferred: ``1 -
factor`` on the device, once). Since then 1 kernel fewer forward (2 deferred): one product
of both targets by the factor (the rows of one tensor), and a deferred call's ``1 - factor``
made in the kernel that makes its factor from the checks' flags (a ``rsub`` before). Before:
a no-op view of the shift, views and selects that one ``as_strided`` or ``split_with_sizes``
now replaces, and a ``detach`` outside grad mode (4 calls forward, 1 backward); the output's
offset computed for low-precision calls too (2 kernels); masked CPU calls keeping the count
and position on the device (58 / 37); the mask converted to integer words and to floats
before the passes that take it (61 / 40); the per-channel maths before they were regrouped
(deferred 51 / 39 and 17 / 13). One stack instead of two for the per-channel conversions
would save 2 kernels more, but ``saved`` would then be a view that keeps the other rows
alive for backward (tests/test_collectives.py: no more saved than BatchNorm).

Under ``torch.compile`` the maths are fused into the graph's kernels, and what each call
still issues on its own is the body of the ``syncbn::`` ops (:mod:`syncbn._compiled`):
kernels forward 5 (immediate) or 8 (deferred), backward 3 (4 before its gradient was
written with one ``torch.cat`` into the output, rather than a copy into a slice and a
``zero_`` of another).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import syncbn
from syncbn import _compiled
from syncbn._autograd import LayerInfo, LocalReducer, TrainOptions, sync_batch_norm_train

#: per training call and direction, (aten calls, kernels), with a little headroom for torch
#: versions; "deferred" is the check mode of accelerators (checks and running statistics on
#: the device, no host read)
BUDGETS = {
    "unmasked": {"forward": (47, 37), "backward": (17, 11)},
    "masked": {"forward": (62, 43), "backward": (29, 17)},
    "deferred": {"forward": (61, 42), "backward": (17, 11)},
    "bfloat16": {"forward": (45, 36), "backward": (19, 13)},
}


#: every test reads the deferred checks its calls left (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("no_checks_left_pending")


#: ops that only allocate memory (no launch on a GPU)
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided"})


class _Ops(TorchDispatchMode):
    """Records every aten call: its name, the call itself with its arguments (``calls``,
    which keeps them alive while the record does), and the names of the kernels they launch
    on a GPU (not views, not bare allocations; see :func:`_launches`)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.calls: list[tuple[Any, Any, dict[str, Any]]] = []
        self.kernels: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.names.append(name)
        self.calls.append((func, args, kwargs or {}))
        result = func(*args, **(kwargs or {}))
        if not func.is_view and name not in _ALLOCATIONS:
            self.kernels.extend([name] * _launches(name, args, result))
        return result


def _launches(name: str, args: Any, result: Any) -> int:
    """Kernels one op launches on CUDA: one, except a concatenation whose inputs are not
    all of the output's dtype, which CUDA copies one input at a time."""
    if name in ("cat", "stack") and any(t.dtype != result.dtype for t in args[0]):
        return len(args[0])
    return 1


def train_call(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    options: TrainOptions,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One synchronized training call (also for tests/test_kernels_finalize.py)."""
    return sync_batch_norm_train(
        x,
        weight,
        bias,
        options,
        running_mean=running_mean,
        running_var=running_var,
        num_batches_tracked=num_batches_tracked,
        mask=mask,
    )


@pytest.mark.parametrize("kind", sorted(BUDGETS))
def test_a_training_call_stays_within_its_op_budget(kind: str) -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32  # float32 parameters
    x = torch.randn(4, 8, 3, 3).to(dtype).requires_grad_()
    dy = torch.randn_like(x)
    mask = torch.rand(4, 3, 3) < 0.7 if kind == "masked" else None
    check_mode = "deferred" if kind == "deferred" else "auto"  # auto: immediate on the CPU
    weight, bias = torch.rand(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    running_mean, running_var = torch.zeros(8), torch.ones(8)
    num_batches_tracked = torch.zeros((), dtype=torch.long)
    options = TrainOptions(LocalReducer(), LayerInfo("budget", 8, check_mode=check_mode))

    def call() -> torch.Tensor:
        buffers = (running_mean, running_var, num_batches_tracked)
        return train_call(x, weight, bias, options, *buffers, mask=mask)

    torch.autograd.grad(call(), (x, weight, bias), dy)  # first-call caches filled
    with _Ops() as forward:
        y = call()
    with _Ops() as backward:
        torch.autograd.grad(y, (x, weight, bias), dy)
    for direction, ops in (("forward", forward), ("backward", backward)):
        calls, kernels = BUDGETS[kind][direction]
        assert len(ops.names) <= calls, f"{direction}: {' '.join(ops.names)}"
        assert len(ops.kernels) <= kernels, f"{direction} kernels: {' '.join(ops.kernels)}"
    # the two passes a call cannot do without: the local sums and the output
    assert "native_batch_norm_backward" in forward.names, forward.names
    assert "native_batch_norm_backward" in backward.names, backward.names


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_a_low_precision_backward_off_the_cpu_converts_its_input_once(masked: bool) -> None:
    """Off the CPU a bfloat16 backward sums from float32 copies (``backward_reduce``: a GPU
    kernel accumulates such data in its own dtype) and computes its input gradient from a
    float32 input (rounded once, as torch's): one copy of the input serves both. Each made
    its own before 2026-12-08, three conversions of a full tensor where two are needed (the
    input and the output gradient), and one back. The meta device takes that path on the
    CPU machine (its ops run no kernel; what is counted is the calls)."""
    meta = torch.device("meta")
    x = torch.empty(4, 8, 3, 3, device=meta, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.empty(8, device=meta, requires_grad=True)
    bias = torch.empty(8, device=meta, requires_grad=True)
    mask = torch.ones(4, 3, 3, dtype=torch.bool, device=meta) if masked else None
    options = TrainOptions(LocalReducer(), LayerInfo("low", 8, check_mode="deferred"))
    buffers = (torch.empty(8, device=meta), torch.empty(8, device=meta), None)
    y = train_call(x, weight, bias, options, *buffers, mask=mask)
    with _Ops() as backward:
        torch.autograd.grad(y, (x, weight, bias), torch.empty_like(y))
    conversions = [
        (args[0].dtype, kwargs.get("dtype"))
        for func, args, kwargs in backward.calls
        if func.overloadpacket.__name__ == "_to_copy" and args[0].shape == x.shape
    ]
    widened, narrowed = (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)
    assert sorted(conversions, key=str) == [widened, widened, narrowed], conversions


def test_a_failure_of_the_low_precision_backwards_float32_copy_joins_the_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """That copy is the backward's largest allocation, so the likeliest to run out of
    memory: made before the block that joins the collective with the error flag (a review,
    2026-12-08), it failed on its rank alone, and the other ranks waited in their backward
    collective until the process group's timeout."""
    joined: list[str] = []

    class Reducer(LocalReducer):
        def all_reduce(self, buffer: torch.Tensor, phase: str) -> torch.Tensor:
            joined.append(phase)
            return super().all_reduce(buffer, phase)

    meta = torch.device("meta")
    x = torch.empty(4, 8, 3, 3, device=meta, dtype=torch.bfloat16, requires_grad=True)
    options = TrainOptions(Reducer(), LayerInfo("low", 8, check_mode="deferred"))
    y = train_call(x, None, None, options, None, None, None)
    joined.clear()
    widen = torch.Tensor.to

    def out_of_memory(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.shape == x.shape and tensor.dtype == torch.bfloat16:
            raise MemoryError("simulated: out of memory for the float32 copy")
        return widen(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", out_of_memory)
    with pytest.raises(MemoryError, match="the float32 copy"):
        torch.autograd.grad(y, x, torch.empty_like(y))
    assert joined == ["backward"]


#: kernels per call of the compiled ops' bodies, forward by check mode, and backward
COMPILED_BUDGETS = {"immediate": 6, "deferred": 9, "backward": 4}


@pytest.mark.parametrize("check_mode", ["immediate", "deferred"])
def test_the_compiled_ops_stay_within_their_kernel_budget(check_mode: str) -> None:
    # the ops' Python bodies, as a compiled graph runs them once per layer and step (the
    # dispatch mode does not see inside an op called through the dispatcher)
    layer = syncbn.SyncBatchNorm(8)  # no process group: local sums
    layer.check_mode = check_mode
    moments = torch.rand(2 * 8 + 1, dtype=torch.float64)
    moments[0] = 36.0  # the count
    order = _compiled.order_token(moments.device)
    grad = torch.empty_like(moments)

    def forward() -> Any:
        counted, site, revision = layer.num_batches_tracked, layer._site, _compiled.REVISION
        return _compiled._sync_moments(moments, order, counted, site, "", 0.1, 1e-5, True, revision)

    def backward() -> None:
        _compiled._sync_moments_backward(moments, order, grad, layer._site, "")

    forward()  # first-call caches filled
    backward()
    with _Ops() as forward_ops:
        global_moments, update, _ = forward()
    with _Ops() as backward_ops:
        backward()
    assert len(forward_ops.kernels) <= COMPILED_BUDGETS[check_mode], forward_ops.kernels
    assert len(backward_ops.kernels) <= COMPILED_BUDGETS["backward"], backward_ops.kernels
    # one process: the global moments are the local ones, the update a full step
    torch.testing.assert_close(global_moments, moments, rtol=0, atol=0)
    torch.testing.assert_close(update, torch.tensor([1.0, 0.1], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.cat([torch.zeros(1, dtype=grad.dtype), moments[1:]]))


#: aten calls that read a tensor's value back to the host (``item``, ``bool``, ``int``, a
#: ``nonzero``...): on a GPU, each waits for the device. (The checks' headers are read with
#: ``Tensor.tolist``, which no dispatch mode sees: at once on the CPU, and on a GPU from a
#: host copy whose event has completed.)
_HOST_READS = frozenset({"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "allclose"})


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_deferred_calls_read_no_value_back(masked: bool) -> None:
    """Deferred checks, the accelerators' mode, read no value back in a training call,
    masked or not; an immediate CPU call reads a masked batch's valid count, whether its
    first position is valid, and where the first valid one is (free on the CPU)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 3, 3, requires_grad=True)
    dy = torch.randn_like(x)
    mask = torch.rand(4, 3, 3) < 0.7 if masked else None
    if mask is not None:
        mask[0, 0, 0] = False  # the first valid position is searched for
    weight, bias = torch.rand(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    reads = {}
    for check_mode in ("deferred", "immediate"):
        options = TrainOptions(LocalReducer(), LayerInfo("reads", 8, check_mode=check_mode))
        buffers = (torch.zeros(8), torch.ones(8), torch.zeros((), dtype=torch.long))
        with _Ops() as ops:
            y = train_call(x, weight, bias, options, *buffers, mask=mask)
            torch.autograd.grad(y, (x, weight, bias), dy)
        reads[check_mode] = [name for name in ops.names if name in _HOST_READS]
    assert reads["deferred"] == []
    assert reads["immediate"] == (["_local_scalar_dense"] * 3 if masked else [])
