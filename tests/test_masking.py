"""``syncbn.masking``: a block's mask reaches the layers a model cannot pass one to.

The layers sit in an ``nn.Sequential`` (as in torchaudio's Conformer convolution module),
so only the block can give them the mask. Results are held to the gold reference of
tests/test_masked.py (``torch.nn.BatchNorm1d`` on the valid positions of all ranks,
gathered, in float64; NaN at padded positions of the input and the output gradient), and
to the same model called with the mask passed, bit for bit.
"""

from __future__ import annotations

import copy
import pickle
import threading
from typing import Any, cast

import pytest
import torch
import torch.utils.checkpoint
from _harness import WorkerPool, outcome
from test_masked import _COMPILE, MaskedCase, _assert_matches, _layer, _valid_rows
from torch import nn

import syncbn
from syncbn.data_parallel import SynchronizedBatchNorm1d


def _sequential(case: MaskedCase) -> nn.Sequential:
    """The gold test's layer, in an ``nn.Sequential`` that passes no mask."""
    return nn.Sequential(_layer(case).bn)


def _run_in_block(
    rank: int, world_size: int, case: MaskedCase, wrap: str = "", checkpoint: bool = False
) -> dict[str, Any]:
    """The gold test's steps, each in ``with syncbn.masking(mask):``, on ``case.device``
    (tests/test_cuda.py runs them on "cuda"); ``wrap``: ``"ddp"`` (DistributedDataParallel)
    or ``"compile"`` (``case.mode`` is the backend)."""
    torch._dynamo.reset()
    model = _sequential(case).to(case.device)
    run: Any = model
    if wrap == "ddp":
        run = nn.parallel.DistributedDataParallel(model)
    elif wrap == "compile":
        run = torch.compile(model, fullgraph=True, backend=case.mode)
    records = []
    for step in range(case.steps):
        x, mask, grad = (t.to(case.device) for t in case.data(rank, step))
        x.requires_grad_()
        with syncbn.masking(mask):
            if checkpoint:
                y = torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False)
            else:
                y = run(x)
            y.backward(grad)  # inside the block: a checkpointed forward is recomputed here
        bn = cast(syncbn.SyncBatchNorm, model[0])
        records.append(
            {
                "output": y.detach().cpu(),
                "grad_input": x.grad.cpu(),  # type: ignore[union-attr]
                "grad_weight": bn.weight.grad.cpu(),  # type: ignore[union-attr]
                "grad_bias": bn.bias.grad.cpu(),  # type: ignore[union-attr]
            }
        )
        model.zero_grad()
    if case.device != "cpu":
        syncbn._protocol.raise_deferred(wait=True)  # a deferred problem fails the scenario
    return {"steps": records, "state": {k: v.cpu() for k, v in model[0].state_dict().items()}}


# ---------------------------------------------------------------- one process, no group


def test_a_block_masks_the_layers_of_a_sequential() -> None:
    case = MaskedCase(sizes=(5,), valid=(0.6,), steps=3)
    _assert_matches(case, [_run_in_block(0, 1, case)])


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_block_equals_passing_the_mask_bit_for_bit(training: bool) -> None:
    case = MaskedCase(sizes=(4,), valid=(0.7,), tail=(3, 4, 5))
    x, mask, grad = case.data(0, 0)
    results = []
    for in_block in (True, False):
        layer = _layer(case).bn.train(training)
        with torch.no_grad():  # running statistics of a batch, for the eval run
            layer.running_mean.uniform_(-1, 1)  # type: ignore[union-attr]
            layer.running_var.uniform_(0.5, 2)  # type: ignore[union-attr]
        xi = x.clone().requires_grad_()
        if in_block:
            with syncbn.masking(mask):
                y = layer(xi)
        else:
            y = layer(xi, mask)
        y.backward(grad)
        results.append(
            [y, xi.grad, layer.weight.grad, layer.bias.grad, *layer.state_dict().values()]
        )
    for got, expected in zip(*results):
        assert torch.equal(got, expected)
    assert bool((results[0][0].movedim(1, -1)[~mask] == 0).all())


def test_blocks_nest_a_passed_mask_wins_and_masking_none_unmasks() -> None:
    torch.manual_seed(0)
    layer = syncbn.SyncBatchNorm(3, track_running_stats=False).double()
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    outer, inner = torch.rand(4, 6) < 0.5, torch.rand(4, 6) < 0.7
    outer[0, 0] = inner[0, 0] = outer[1, 1] = inner[1, 1] = True  # more than 1 valid value
    # each mask's result, computed outside any block
    with_outer, with_inner = layer(x, outer), layer(x, inner)
    unmasked = torch.nn.functional.batch_norm(x, None, None, training=True)
    assert not torch.equal(with_outer, with_inner)
    with syncbn.masking(outer):
        assert torch.equal(layer(x), with_outer)
        with syncbn.masking(inner):
            assert torch.equal(layer(x), with_inner)  # the innermost block
            assert torch.equal(layer(x, outer), with_outer)  # a passed mask wins
        assert torch.equal(layer(x), with_outer)  # the outer block again
        with syncbn.masking(None):
            assert torch.equal(layer(x), unmasked)
        # one instance entered again inside its own block: closing both restores the outer
        # block (a single saved state restored none: the layer then ran unmasked)
        block = syncbn.masking(inner)
        with block:
            with block:
                assert torch.equal(layer(x), with_inner)
            assert torch.equal(layer(x), with_inner)
        assert torch.equal(layer(x), with_outer)
    assert torch.equal(layer(x), unmasked)  # every block closed


def test_a_data_parallel_layer_takes_the_blocks_mask() -> None:
    torch.manual_seed(0)
    layer = SynchronizedBatchNorm1d(3).double()
    twin = SynchronizedBatchNorm1d(3).double()
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    mask = torch.rand(4, 6) < 0.6
    with syncbn.masking(mask):
        y = layer(x)
    assert torch.equal(y, twin(x, mask))
    torch.testing.assert_close(layer.running_mean, twin.running_mean, rtol=0, atol=0)


class _InBlock(nn.Module):
    """Takes ``(input, mask)`` batches; a syncbn layer and a torch one, both in a block."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.masked = syncbn.SyncBatchNorm(channels)
        self.plain = nn.BatchNorm1d(channels)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        x, mask = batch
        with syncbn.masking(mask):
            return self.masked(x), self.plain(x)


def test_precise_statistics_count_the_valid_positions_of_a_block() -> None:
    case = MaskedCase(sizes=(4,), valid=(0.6,), tail=(3, 9), steps=3)
    batches = [(x.nan_to_num(), mask) for x, mask, _ in map(case.data, [0] * 3, range(3))]
    model = _InBlock(3).double()
    syncbn.recompute_statistics(model, batches)
    rows = torch.cat([_valid_rows(x, mask) for x, mask in batches])
    torch.testing.assert_close(model.masked.running_mean, rows.mean(0))
    torch.testing.assert_close(model.masked.running_var, rows.var(0))  # unbiased, as torch's
    # torch's BatchNorm ignores the block: every position
    every = torch.cat([x.movedim(1, -1).reshape(-1, 3) for x, _ in batches])
    torch.testing.assert_close(model.plain.running_mean, every.mean(0))
    assert not torch.allclose(every.mean(0), rows.mean(0))


def test_a_layer_called_in_a_block_still_pickles_and_copies() -> None:
    model = nn.Sequential(syncbn.SyncBatchNorm(3))
    mask = torch.rand(4, 6) < 0.6
    mask[0, :2] = True
    with syncbn.masking(mask):
        model(torch.randn(4, 3, 6))
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        x = torch.randn(4, 3, 6)
        torch.testing.assert_close(copied(x), model(x))  # no block: both unmasked


def test_an_invalid_block_mask_is_a_clear_error() -> None:
    layer = syncbn.SyncBatchNorm(3)
    with pytest.raises(TypeError, match="expected mask to be a torch.Tensor or None"):
        syncbn.masking([True, False])  # type: ignore[arg-type]
    with syncbn.masking(torch.ones(4, 7, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"expected mask of shape \(4, 6\)"):
            layer(torch.randn(4, 3, 6))
        with pytest.raises(TypeError, match="expected mask of dtype torch.bool"):
            with syncbn.masking(torch.ones(4, 6)):
                layer(torch.randn(4, 3, 6))


def test_a_layer_in_another_thread_refuses_to_run_unmasked() -> None:
    torch.manual_seed(0)
    layer = syncbn.SyncBatchNorm(3, track_running_stats=False)
    x = torch.randn(4, 3, 6)
    mask = torch.rand(4, 6) < 0.6
    mask[0, :2] = True
    results: dict[str, Any] = {}

    def call(key: str, block: Any) -> None:
        try:
            if block is False:  # no block in this thread
                results[key] = layer(x)
            else:
                with syncbn.masking(block):
                    results[key] = layer(x)
        except RuntimeError as error:
            results[key] = error

    with syncbn.masking(mask):
        for key, block in (("none", False), ("unmasked", None), ("own", mask)):
            thread = threading.Thread(target=call, args=(key, block))
            thread.start()
            thread.join(timeout=30)
    assert isinstance(results["none"], RuntimeError)
    assert "open in another thread" in str(results["none"])
    assert torch.equal(
        results["unmasked"], torch.nn.functional.batch_norm(x, None, None, training=True)
    )
    assert torch.equal(results["own"], layer(x, mask))
    call("after", False)  # every block closed: a plain call again
    assert torch.equal(results["after"], results["unmasked"])


@pytest.mark.parametrize("thread", ["same", "other"], ids=["same-thread", "other-thread"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_recomputes_with_the_blocks_mask(use_reentrant: bool, thread: str) -> None:
    """``backward()`` inside the block. In another thread than the forward's: on CUDA,
    autograd runs the backward, and checkpointing's recomputation in it, in a thread of its
    own per device, which has no block; the recomputed layer raised "a syncbn.masking block
    is open in another thread" there (the CPU runs a backward in the calling thread, so the
    test calls it in another one, with the block still open in the forward's)."""
    case = MaskedCase(sizes=(5,), valid=(0.6,))
    x, mask, grad = case.data(0, 0)
    results = []
    for checkpointed in (True, False):
        model = _sequential(case)
        xi = x.clone().requires_grad_()
        errors: list[BaseException] = []
        with syncbn.masking(mask):
            if checkpointed:
                y = torch.utils.checkpoint.checkpoint(model, xi, use_reentrant=use_reentrant)
            else:
                y = model(xi)
            if thread == "same":
                y.backward(grad)
            else:
                _backward_in_another_thread(y, grad, errors)
        if errors:
            raise errors[0]
        bn = model[0]
        results.append([y, xi.grad, bn.weight.grad, bn.bias.grad, *bn.state_dict().values()])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def test_a_recomputation_in_another_thread_that_cannot_tell_its_mask_is_a_clear_error() -> None:
    case = MaskedCase(sizes=(5,), valid=(0.6,))
    x, mask, grad = case.data(0, 0)
    model = _sequential(case)
    with syncbn.masking(mask):
        y = torch.utils.checkpoint.checkpoint(
            model, x.clone().requires_grad_(), use_reentrant=False
        )
    errors: list[BaseException] = []
    _backward_in_another_thread(y, grad, errors)
    assert len(errors) == 1 and "no syncbn.masking block is open" in str(errors[0])
    # the layer called again in another (nested) block before the backward: its latest
    # call's mask is not this forward's, so the other thread refuses to guess (it took
    # that mask, silently: a review)
    errors.clear()
    with syncbn.masking(mask):
        y = torch.utils.checkpoint.checkpoint(
            model, x.clone().requires_grad_(), use_reentrant=False
        )
        with syncbn.masking(mask[:, :3]):
            model(x[:, :, :3])
        _backward_in_another_thread(y, grad, errors)
    assert len(errors) == 1 and "a syncbn.masking block is open in another thread" in str(
        errors[0]
    ), errors


def _backward_in_another_thread(
    y: torch.Tensor, grad: torch.Tensor, errors: list[BaseException]
) -> None:
    """``y.backward(grad)`` in a thread of its own, as autograd runs a CUDA backward; what
    it raises is appended to ``errors``."""

    def backward() -> None:
        try:
            y.backward(grad)
        except BaseException as error:  # re-raised (or checked) in the test's thread
            errors.append(error)

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the backward did not end within 60 s"


def test_a_checkpointed_function_may_build_its_mask_and_open_the_block_itself() -> None:
    case = MaskedCase(sizes=(5,), valid=(0.6,))
    x, mask, grad = case.data(0, 0)
    lengths = mask.sum(1)  # the mask, built again from the lengths at each run

    def segment(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        valid = torch.arange(x.shape[-1]) < lengths[:, None]
        with syncbn.masking(valid):
            return model(x)  # type: ignore[no-any-return]

    results = []
    for checkpointed in (True, False):
        model = _sequential(case)
        xi = x.nan_to_num().requires_grad_()
        if checkpointed:
            y = torch.utils.checkpoint.checkpoint(segment, model, xi, use_reentrant=False)
        else:
            y = segment(model, xi)
        y.backward(grad.nan_to_num())  # outside any block
        bn = model[0]
        results.append([y, xi.grad, bn.weight.grad, bn.bias.grad, *bn.state_dict().values()])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_recomputation_outside_the_block_is_a_clear_error() -> None:
    case = MaskedCase(sizes=(5,), valid=(0.6,))
    x, mask, grad = case.data(0, 0)
    model = _sequential(case)
    xi = x.clone().requires_grad_()
    with syncbn.masking(mask):
        y = torch.utils.checkpoint.checkpoint(model, xi, use_reentrant=False)
    with pytest.raises(RuntimeError, match="no syncbn.masking block is open, but its first"):
        y.backward(grad)
    # the other way round: a first forward without a block, recomputed inside one
    xi = x.nan_to_num().requires_grad_()
    y = torch.utils.checkpoint.checkpoint(model, xi, use_reentrant=False)
    with (
        syncbn.masking(mask),
        pytest.raises(RuntimeError, match="but its first forward ran in none"),
    ):
        y.backward(grad.nan_to_num())
    # a block of another mask's shape than the forward's (it would broadcast)
    with syncbn.masking(mask):
        y = torch.utils.checkpoint.checkpoint(model, xi, use_reentrant=False)
    with (
        syncbn.masking(mask[:1]),
        pytest.raises(RuntimeError, match="mask has another shape than its first forward's"),
    ):
        y.backward(grad.nan_to_num())


@pytest.mark.skipif(not _COMPILE, reason="fullgraph compile needs torch >= 2.4")
def test_six_batch_sizes_in_blocks_compile_as_often_as_with_passed_masks() -> None:
    """Issue 20's recompile budget: a first graph, one with dynamic sizes, one for an empty
    batch (3 graphs, 2 recompiles), with the block as with a mask passed to the layer."""
    counts = []
    for in_block in (True, False):
        graphs = []

        def counting(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
            graphs.append(graph)  # noqa: B023 - used while this iteration runs
            return graph.forward

        torch._dynamo.reset()
        layer, twin = syncbn.SyncBatchNorm(3).double(), syncbn.SyncBatchNorm(3).double()
        compiled = torch.compile(layer, fullgraph=True, backend=counting)
        torch.manual_seed(0)
        for size in (5, 3, 7, 0, 2, 9):
            x = torch.randn(size, 3, 6, dtype=torch.float64)
            mask = torch.rand(size, 6) < 0.6
            mask[:1, :2] = True
            if in_block:
                with syncbn.masking(mask):
                    y = compiled(x)
            else:
                y = compiled(x, mask)
            torch.testing.assert_close(y, twin(x, mask), rtol=1e-12, atol=1e-12)
        counts.append(len(graphs))
    assert counts[0] == counts[1] <= 3, counts


@pytest.mark.skipif(not _COMPILE, reason="fullgraph compile needs torch >= 2.4")
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_under_compile_a_new_mask_each_step_compiles_nothing_new(training: bool) -> None:
    graphs = []

    def counting(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    layer = syncbn.SyncBatchNorm(3).double().train(training)
    twin = syncbn.SyncBatchNorm(3).double().train(training)
    compiled = torch.compile(layer, fullgraph=True, backend=counting)
    torch.manual_seed(0)
    for _ in range(4):
        x = torch.randn(4, 3, 6, dtype=torch.float64)
        mask = torch.rand(4, 6) < 0.6
        mask[0, :2] = True
        with syncbn.masking(mask):
            y = compiled(x)
        torch.testing.assert_close(y, twin(x, mask), rtol=1e-12, atol=1e-12)
    assert len(graphs) == 1, f"{len(graphs)} graphs for 4 masks of one shape"
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    torch.testing.assert_close(compiled(x), twin(x), rtol=1e-12, atol=1e-12)  # no block
    torch.testing.assert_close(layer.running_var, twin.running_var, rtol=1e-12, atol=1e-12)


#: dynamo traces a user-defined context manager: torch 2.6 does, 2.4 refuses one
_BLOCKS_IN_COMPILED_CODE = torch.torch_version.TorchVersion(torch.__version__) >= "2.6"


@pytest.mark.skipif(
    not _BLOCKS_IN_COMPILED_CODE, reason="dynamo traces a user-defined `with` from torch 2.6"
)
def test_a_block_opened_inside_compiled_code() -> None:
    torch._dynamo.reset()
    case = MaskedCase(sizes=(5,), valid=(0.6,))
    model, twin = _sequential(case), _sequential(case)

    def step(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with syncbn.masking(mask):
            return model(x)  # type: ignore[no-any-return]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for index in range(2):
        x, mask, grad = case.data(0, index)
        xi, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, expected = compiled(xi, mask), twin[0](xt, mask)
        y.backward(grad)
        expected.backward(grad)
        torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(xi.grad, xt.grad, rtol=1e-12, atol=1e-12)
    x = case.data(0, 0)[0].nan_to_num()
    torch.testing.assert_close(model(x), twin(x), rtol=1e-12, atol=1e-12)  # the block closed


@pytest.mark.skipif(
    not hasattr(torch.compiler, "is_exporting"), reason="torch.compiler.is_exporting needed"
)
def test_torch_export_refuses_to_keep_a_blocks_mask_as_a_constant() -> None:
    layer = syncbn.SyncBatchNorm(3).eval()
    x, mask = torch.randn(4, 3, 6), torch.rand(4, 6) < 0.6
    with syncbn.masking(mask), pytest.raises(RuntimeError, match="as a constant"):
        torch.export.export(layer, (x,), strict=False)
    exported = torch.export.export(layer, (x, mask), strict=False)  # the mask an input: fine
    torch.testing.assert_close(exported.module()(x, mask), layer(x, mask))


# ---------------------------------------------------------------- several ranks


def test_on_every_rank_the_block_gives_the_global_valid_statistics(pool: WorkerPool) -> None:
    case = MaskedCase(sizes=(4, 0, 3)[: pool.world_size], valid=(0.6, 0.8, 0.5)[: pool.world_size])
    _assert_matches(case, pool.run(_run_in_block, case))


def test_under_ddp_with_checkpointing(pool2: WorkerPool) -> None:
    case = MaskedCase(sizes=(4, 3), valid=(0.6, 0.8))
    _assert_matches(case, pool2.run(_run_in_block, case, "ddp", True))


@pytest.mark.skipif(not _COMPILE, reason="fullgraph compile needs torch >= 2.4")
def test_compiled_on_two_ranks(pool2: WorkerPool) -> None:
    case = MaskedCase(sizes=(4, 3), valid=(0.6, 0.8), mode="aot_eager", steps=3)
    _assert_matches(case, pool2.run(_run_in_block, case, "compile"))


def _recompute_outside_the_block_on_rank_0(rank: int, world_size: int) -> tuple[str, str]:
    """Checkpointed training on every rank; rank 0 alone forwards in a block and calls
    backward outside it, so that its recomputation refuses to run."""
    case = MaskedCase(sizes=(4, 3), valid=(0.6, 0.8))
    x, mask, grad = case.data(rank, 0)
    model = _sequential(case)
    xi = x.nan_to_num().requires_grad_()
    with syncbn.masking(mask if rank == 0 else None):
        y = torch.utils.checkpoint.checkpoint(model, xi, use_reentrant=False)
    return outcome(y.backward, grad.nan_to_num())


def test_a_refused_recomputation_on_one_rank_raises_on_every_rank(pool2: WorkerPool) -> None:
    rank0, rank1 = pool2.run(_recompute_outside_the_block_on_rank_0, timeout=40.0)
    assert rank0[0] == "RuntimeError" and "no syncbn.masking block is open" in rank0[1], rank0
    assert rank1[0] == "RuntimeError" and "other rank(s) failed" in rank1[1], rank1
