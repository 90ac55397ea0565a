"""Statistics kernels composed of torch ops that exist on every device.

Local moments are taken on data shifted by one of the batch's own values per channel:
summing shifted data in float32 does not cancel for inputs whose mean is large compared
with their spread. The shift is a median of values spread over the batch
(:func:`sample_shift`), so that one outlier cannot become it, and it is added back exactly
in float64. The big passes are fused torch kernels:
``native_batch_norm_backward`` in eval mode returns per-channel sums, eval-mode
``batch_norm`` applies a per-channel affine map.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from syncbn._protocol import constant_cache, on_device
from syncbn._stats import stat_dtype, unshifted_sums

__all__ = [
    "LocalMoments",
    "backward_reduce",
    "channel_view",
    "constants",
    "corrected_input_grad",
    "dense_format",
    "first_valid_sample",
    "in_place_masked",
    "input_grad",
    "lattice_offsets",
    "local_moments",
    "masked_input_grad",
    "normalize",
    "output_format",
    "output_offset",
    "reuses_shifted_copy",
    "ShiftLattice",
    "sample_shift",
    "shift_lattice",
    "shifted_sums",
    "zero_padded",
]

_PACK_DTYPE = torch.float64


class LocalMoments(NamedTuple):
    """One rank's per-channel moments, and what normalization may reuse."""

    #: ``(C,)`` float64: sum of the local batch (zeros if empty)
    total: torch.Tensor
    #: ``(C,)`` float64: sum of squares of the local batch (zeros if empty)
    square_total: torch.Tensor
    #: ``(C,)``: the per-channel shift subtracted before summing, in float64 (in the
    #: statistics dtype from :func:`syncbn._kernels.finalize.pack_forward`)
    shift: torch.Tensor
    #: the shifted copy, in the statistics dtype and the input's memory format, or ``None``
    centered: torch.Tensor | None
    #: the number of values per channel: a number, or for a masked call the number of
    #: valid positions as a 0-dim float64 tensor
    local_count: int | torch.Tensor


def channel_view(vector: torch.Tensor, ndim: int) -> torch.Tensor:
    """View a ``(C,)`` vector so it broadcasts against an ``(N, C, *)`` tensor of ``ndim`` dims."""
    return vector.view(1, -1, *(1,) * (ndim - 2))  # sizes as arguments: parsed faster than a list


@constant_cache(maxsize=64)
def constants(
    num_channels: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean 0 and variance (or weight) 1, which turn batch-norm kernels into plain sums, and
    an empty tensor for the saved statistics of an eval-mode backward (CUDA requires one)."""
    zeros, ones = on_device([[0.0] * num_channels, [1.0] * num_channels], dtype, device)
    return zeros, ones, zeros.new_empty(0)


#: the dimensions of a channels-last tensor, from the smallest stride to the largest
_CHANNELS_LAST_ORDER = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}


def _channels_last_like(input: torch.Tensor) -> bool:
    """Whether torch's ``suggest_memory_format`` calls ``input``'s strides channels last.

    The strides must grow in channels-last order (each at least the extent of the dimension
    before it); torch resolves the ambiguous cases (a zero channel stride, an empty
    dimension, strides that do not tell channels from samples) as contiguous.
    """
    order = _CHANNELS_LAST_ORDER.get(input.dim())
    if order is None or input.stride(1) == 0:
        return False
    extent = 0
    for dim in order:
        size, stride = input.shape[dim], input.stride(dim)
        if size == 0 or stride < extent or (dim == 0 and extent == input.stride(1)):
            return False
        extent = stride * max(size, 1)
    return True


def dense_format(tensor: torch.Tensor) -> torch.memory_format | None:
    """The memory format ``tensor`` is contiguous in (contiguous, channels last), or ``None``."""
    if tensor.is_contiguous():
        return torch.contiguous_format
    for format, ndim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if tensor.dim() == ndim and tensor.is_contiguous(memory_format=format):
            return format
    return None


def output_format(input: torch.Tensor) -> torch.memory_format | None:
    """The memory format torch's batch norm gives the output for ``input``, where an
    element-wise op on ``input`` would give another; ``None`` where it gives the same.

    torch's output is channels last for a 4-D or 5-D input whose strides are channels
    last, and contiguous otherwise, while element-wise ops keep any dense input's strides:
    a transposed ``(N, L, C)`` batch (``x.transpose(1, 2)``) would give an output that
    ``.view`` refuses.
    """
    if dense_format(input) is not None:
        return None
    if _channels_last_like(input):
        return torch.channels_last if input.dim() == 4 else torch.channels_last_3d
    return torch.contiguous_format


def _subtract(input: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``input - shift`` (same dtypes) in the memory format of torch's batch-norm output."""
    format = output_format(input)
    if format is None:
        return torch.sub(input, shift)
    return torch.sub(input, shift, out=torch.empty_like(input, memory_format=format))


def _untracked(input: torch.Tensor) -> torch.Tensor:
    """``input`` for the local passes, whose shifted copy is later written in place: itself
    where grad mode is off (a training call's forward, :mod:`syncbn.precise`), else
    detached (one op fewer where it is not needed)."""
    return input.detach() if torch.is_grad_enabled() else input


def _center(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input - shift, shift)`` with the :func:`sample_shift` in broadcast shape.

    The shifted copy is in the statistics dtype and the memory format of torch's
    batch-norm output (:func:`output_format`); for float32 and float64 inputs it later
    becomes the output, so forward allocates no more than BatchNorm does.
    """
    dtype = stat_dtype(input.dtype)
    detached = _untracked(input)
    shift = sample_shift(detached)
    if input.dtype == dtype:
        return _subtract(detached, shift), shift
    # low precision: convert, then subtract in place (a mixed-dtype subtraction is ~20x slower)
    shift = shift.to(dtype)
    format = output_format(input) or torch.preserve_format
    return detached.to(dtype, memory_format=format).sub_(shift), shift


class ShiftLattice(NamedTuple):
    """Where :func:`sample_shift` reads its 3 x 3 values in an ``(N, C, *)`` tensor: from
    the position ``start`` (one index per dimension; the channel's is 0), 3 groups
    ``group_step`` apart along dimension ``group_dim``, each of 3 members ``member_step``
    apart along ``member_dim``."""

    start: tuple[int, ...]
    group_dim: int
    group_step: int
    member_dim: int
    member_step: int


def _spread(size: int, count: int) -> tuple[int, int]:
    """Start and step of ``count`` indices spread evenly over ``range(size)`` and centred in
    it; the step is 0 (every index the same) where ``size < count``."""
    step = size // count
    return (size - (count - 1) * step - 1) // 2, step


def shift_lattice(shape: torch.Size | tuple[int, ...]) -> ShiftLattice:
    """The 9 positions of :func:`sample_shift` in a non-empty batch of ``shape``.

    Groups are 3 samples spread over the batch (outliers often come a sample at a time: one
    bad image, one odd sequence), members 3 positions spread along the last dimension, at
    the middle of the others. An ``(N, C)`` batch spreads all 9 over its samples. Sizes may
    be symbolic (under ``torch.compile``): only floor divisions, no comparison, so no guard.
    """
    ndim = len(shape)
    start = [size // 2 for size in shape]
    start[1] = 0
    if ndim == 2:
        start[0], step = _spread(shape[0], 9)
        return ShiftLattice(tuple(start), 0, 3 * step, 0, step)
    start[0], group_step = _spread(shape[0], 3)
    start[-1], member_step = _spread(shape[-1], 3)
    return ShiftLattice(tuple(start), 0, group_step, ndim - 1, member_step)


def lattice_offsets(x: torch.Tensor, lattice: ShiftLattice) -> tuple[int, int, int]:
    """Where ``lattice``'s values are in ``x``'s memory, in elements from its first: the
    first value's channel 0, and the steps between groups and between members (the
    strided view here, Triton's kernel in :mod:`syncbn._kernels.triton_passes`)."""
    stride = x.stride()
    first = sum(index * stride[dim] for dim, index in enumerate(lattice.start) if dim != 1)
    group = lattice.group_step * stride[lattice.group_dim]
    return first, group, lattice.member_step * stride[lattice.member_dim]


def _lattice_view(x: torch.Tensor, lattice: ShiftLattice) -> torch.Tensor:
    """The 9 values per channel of ``lattice`` as one strided view of ``x`` (no copy), of
    shape ``(3, 3, 1, C, 1, ...)``: the last dimensions broadcast against ``x``'s."""
    first, group, member = lattice_offsets(x, lattice)
    size = (3, 3, 1, x.shape[1]) + (1,) * (x.dim() - 2)
    steps = (group, member, 0, x.stride(1)) + (0,) * (x.dim() - 2)
    return x.as_strided(size, steps, x.storage_offset() + first)


def _lattice_gather(x: torch.Tensor, lattice: ShiftLattice) -> torch.Tensor:
    """:func:`_lattice_view`'s values by indexing instead of ``as_strided``: under
    ``torch.compile`` inductor reads them from ``x``'s producer, where an ``as_strided``
    would make it store ``x`` first. The positions are index tensors, computed from the
    (symbolic) sizes in the graph: integer indices would make dynamo guard on their values
    (one graph per batch size)."""
    steps = torch.arange(3, device=x.device)
    groups, members = steps.view(3, 1) * lattice.group_step, steps.view(1, 3) * lattice.member_step
    index: list[torch.Tensor | slice] = []
    for dim, start in enumerate(lattice.start):
        if dim == 1:
            index.append(slice(None))
            continue
        position = torch.zeros_like(groups) + start  # (3, 1), broadcast to (3, 3)
        if dim == lattice.group_dim:
            position = position + groups
        if dim == lattice.member_dim:
            position = position + members
        index.append(position)
    # advanced indices around a slice: their (3, 3) comes first, then the channels
    return x[tuple(index)].view((3, 3, 1, x.shape[1]) + (1,) * (x.dim() - 2))


def ninther(values: torch.Tensor) -> torch.Tensor:
    """The median of the medians of 3 of ``(3, 3, *)`` values: ``(*)``.

    One of the 9 values, and an outlier only if 4 of them are (two groups need two
    each). A median of 3 is the third value clamped between the min and max of
    the other two: 6 element-wise kernels in all, where ``torch.median`` over a dimension
    costs about 0.5 µs per channel on a CPU, and ``torch.aminmax`` over a pair 3x an
    element-wise ``minimum`` (1024 channels). NaN values give NaN.
    """
    first, second, third = values.unbind(1)
    medians = torch.clamp(third, torch.minimum(first, second), torch.maximum(first, second))
    first, second, third = medians.unbind(0)
    return torch.clamp(third, torch.minimum(first, second), torch.maximum(first, second))


def sample_shift(
    x: torch.Tensor,
    valid: torch.Tensor | None = None,
    fallback: torch.Tensor | None = None,
    in_graph: bool = False,
) -> torch.Tensor:
    """The per-channel shift of a non-empty ``(N, C, *)`` batch, in broadcast shape
    ``(1, C, 1, ...)`` and ``x``'s dtype: the :func:`ninther` of 9 values spread over the
    batch (:func:`shift_lattice`).

    Shifted sums in float32 lose about ``(shift - mean)² / var`` times float32's precision,
    and a single value may lie ``sqrt(n)`` standard deviations from the mean of ``n``
    values: when the shift was the batch's first value, a ``(32, 4, 64, 64)`` batch whose
    first value was 3000 standard deviations out gave an output error of 2.65. The ninther
    is one of the data's values, within their bulk unless 4 of the 9 are outliers; 0 where
    it is not finite.

    Args:
        valid: ``(N, 1, *)`` bool, True at valid positions, or ``None``: padded positions
            among the 9 count as ``fallback`` instead (a padded NaN never becomes the
            shift).
        fallback: for ``valid``: a valid value per channel in broadcast shape (the first
            valid one, or zeros where there is none).
        in_graph: gather the values by indexing (code that ``torch.compile`` traces)
            rather than as one strided view.
    """
    lattice = shift_lattice(x.shape)
    read = _lattice_gather if in_graph else _lattice_view
    values = read(x, lattice)
    if valid is not None:
        if fallback is None:
            raise ValueError("sample_shift: a mask needs a fallback value")
        values = torch.where(read(valid, lattice), values, fallback)
    # a channel whose median is not finite (an inf among a small batch's values, where the
    # 9 samples repeat one position) is shifted by 0: inf - inf made its sums NaN, where
    # torch's batch norm has an infinite mean (its data are not finite either way)
    return ninther(values).nan_to_num_(0.0, 0.0, 0.0)


def _sample_view(
    x: torch.Tensor, offset: int | torch.SymInt, ndim: int | None = None
) -> torch.Tensor:
    """The ``(C,)`` values of ``x`` at one position, ``x[n, :, i, ...]`` (or one row of a
    ``(R, C)`` matrix), as a strided view in broadcast shape ``(1, C, 1, ...)`` of ``ndim``
    dimensions (``x``'s by default), given the storage ``offset`` of its first element:
    one op instead of an index per dimension and a view."""
    ndim = x.dim() if ndim is None else ndim
    return x.as_strided(
        (1, x.shape[1]) + (1,) * (ndim - 2), (0, x.stride(1)) + (0,) * (ndim - 2), offset
    )


def _at_position(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[n, :, i, j, ...]`` at the flat position ``index`` (shape ``(1,)``) of ``(N, *)``.

    A ``(C,)`` tensor, gathered from ``C`` values: the positions are flattened into one
    dimension (a view for contiguous and channels-last inputs, a copy for strides of no
    memory format), then indexed by sample and position. ``index`` stays a tensor, so
    there is no host read, in eager mode or under ``torch.compile``.
    """
    if x.dim() == 2:  # (N, C): a position is a sample
        return x.index_select(0, index).reshape(x.shape[1])
    length = math.prod(x.shape[2:])
    return x.flatten(2)[index // length, :, index % length].reshape(x.shape[1])


#: the integer dtype of each floating dtype's width, for :func:`zero_padded`
_SAME_WIDTH_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def zero_padded(
    tensor: torch.Tensor,
    valid: torch.Tensor,
    inplace: bool = False,
    like: torch.Tensor | None = None,
) -> torch.Tensor:
    """``tensor`` with +0.0 at the padded positions of ``valid`` (``(N, 1, *)`` bool).

    Whatever ``tensor`` holds there (NaN and inf included) is replaced: the result equals
    ``torch.where(valid, tensor, 0.0)``, computed as the product of the bits (an integer
    view of the same width) with the bool mask, which keeps them (times 1) or clears them
    (times 0): one fast pass and one kernel, where a bool ``masked_fill_`` or ``where`` is
    6-10x slower on CPU.

    Args:
        like: a dense tensor of ``tensor``'s shape whose strides a new result takes (a
            backward's input, for the output gradient's zeroed copy): the strides that
            broadcasting gives follow ``tensor``'s, and an expanded output gradient (the
            gradient of ``output.sum()``) gave a contiguous input gradient for a
            channels-last input, where BatchNorm's keeps the input's format.
    """
    int_dtype = _SAME_WIDTH_INT[tensor.dtype]
    bits = tensor.view(int_dtype)
    if inplace:
        return bits.mul_(valid).view(tensor.dtype)
    if like is None:
        return torch.mul(bits, valid).view(tensor.dtype)
    out = torch.empty_like(like, dtype=int_dtype)
    return torch.mul(bits, valid, out=out).view(tensor.dtype)


def first_valid_sample(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The ``(C,)`` values of ``x`` at its first valid position.

    Zeros when no position is valid, so that a padded NaN never becomes a shift. No host
    read: the position stays a tensor.

    Args:
        valid: ``(N, 1, *)``, True (or 1) at the valid positions: bool in eager mode; int32
            in code that inductor compiles, whose max over a bool tensor returns wrong
            indices on CUDA (pytorch/pytorch#174069, fixed in 2026) and, for some shapes,
            on the CPU (#184893); over a uint8 view of the mask it returned 0 (torch 2.13).
    """
    if valid.numel() == 0:
        return x.new_zeros(x.shape[1])
    # the first maximum of the flat mask: whether a position is valid, and the first one (or
    # 0); max over a dim returns the first index of a tie
    any_valid, index = valid.reshape(-1).max(0)
    return torch.where(any_valid.bool(), _at_position(x, index.view(1)), 0.0)


def local_moments(
    input: torch.Tensor, valid: torch.Tensor | None = None, host_reads: bool = False
) -> LocalMoments:
    """Per-channel sum and sum of squares of a local ``(N, C, *)`` batch, in float64.

    One fused pass of ``native_batch_norm_backward`` (eval mode, the shifted data as both
    gradient and input, mean 0, variance 1, eps 0) sums the shifted data and their
    squares; the shift is added back exactly in float64.

    Args:
        valid: ``(N, 1, *)`` bool, True at the positions to count, or ``None`` for all.
            Padded positions are zero in the shifted copy, whatever the input holds there.
        host_reads: a masked batch's valid count and first valid position may be read
            back to the host (see :func:`shifted_sums`).
    """
    num_channels = input.shape[1]
    count: int | torch.Tensor = input.numel() // num_channels
    if count == 0:
        zeros = input.new_zeros(num_channels, dtype=_PACK_DTYPE)
        return LocalMoments(zeros, zeros.clone(), zeros, None, 0)
    shifted_sum, shifted_square_sum, shift, centered, valid_count = shifted_sums(
        input, valid, host_reads
    )
    if valid_count is not None:
        count = valid_count
    # the sums stay in the statistics dtype: the float64 shift promotes the maths that
    # adds it back to float64, inside those kernels
    shift = shift.to(_PACK_DTYPE)
    total, square_total = unshifted_sums(shifted_sum, shifted_square_sum, shift, count)
    return LocalMoments(total, square_total, shift, centered, count)


def _center_valid(
    input: torch.Tensor, valid: torch.Tensor, host_reads: bool = False
) -> tuple[int | torch.Tensor, torch.Tensor, torch.Tensor]:
    """A masked batch's valid count, shifted copy (zero at padded positions) and shift
    (:func:`sample_shift` over the valid positions, in broadcast shape), in the statistics
    dtype.

    The count is a 0-dim float64 tensor, or with ``host_reads`` a number (see
    :func:`shifted_sums`).
    """
    x = _untracked(input).to(stat_dtype(input.dtype))
    count: int | torch.Tensor
    if host_reads:
        count = int(torch.count_nonzero(valid))
        first = _first_valid_view(x, valid, count)
    else:
        count = valid.sum(dtype=_PACK_DTYPE)
        first = channel_view(first_valid_sample(x, valid), input.dim())
    shift = sample_shift(x, valid, first)
    centered = zero_padded(_subtract(x, shift), valid, inplace=True)
    return count, centered, shift


def _first_valid_view(x: torch.Tensor, valid: torch.Tensor, count: int) -> torch.Tensor:
    """:func:`first_valid_sample` in broadcast shape, with the position read back to the
    host: a strided view of ``x``, zeros if ``count`` is 0."""
    if count == 0:
        return x.new_zeros((1, x.shape[1]) + (1,) * (x.dim() - 2))
    # the first position, when it is valid (so is every position, or the batch's first
    # sample starts valid: padded sequences); else the first maximum of the flat mask
    first_valid = count == valid.numel() or bool(valid.as_strided((), ()))  # one view
    index = 0 if first_valid else int(valid.reshape(-1).max(0).indices)
    offset = x.storage_offset()
    for dim in reversed([0, *range(2, x.dim())]):  # the flat index over (N, *) unravelled
        index, position = divmod(index, x.shape[dim])
        offset += position * x.stride(dim)
    return _sample_view(x, offset)


def shifted_sums(
    input: torch.Tensor, valid: torch.Tensor | None = None, host_reads: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int | torch.Tensor | None]:
    """The first steps of :func:`local_moments` for a non-empty batch, for kernels that add
    the shift back themselves: the ``(C,)`` sum and sum of squares of the shifted copy in
    the statistics dtype, the ``(C,)`` shift (:func:`sample_shift`), the shifted copy,
    and for a masked batch (``valid``) its valid count (``None`` unmasked).

    The count and the first valid position of a masked batch stay on the device (a 0-dim
    float64 count; the position gathered by :func:`first_valid_sample`), or with
    ``host_reads`` are read back (a number; the first valid value a strided view). The
    values are the same; the reads save 7 of a masked forward's 58 torch calls, and cost
    nothing on the CPU, where a call whose checks are immediate reads its buffer back
    anyway.
    """
    count = None
    if valid is None:
        centered, shift = _center(input)
    else:
        count, centered, shift = _center_valid(input, valid, host_reads)
    shifted_sum, shifted_square_sum = _sums(centered, shift)
    return shifted_sum, shifted_square_sum, shift.view(-1), centered, count


#: the values of one channel and sample (a plane) beyond which :func:`_in_chunks` splits it,
#: and the rows of ``(N, C)`` or channels-last data beyond which it splits them (the CPU's
#: kernel sums a plane in 16 vector lanes, but each channel of rows in one accumulator)
_PLANE_LIMIT, _ROWS_LIMIT = 65536, 16384
#: the largest chunks, of a plane and of rows
_PLANE_CHUNK, _ROWS_CHUNK = 16384, 4096


class _Chunks(NamedTuple):
    """A tensor viewed so that each channel's values are ``pieces`` channels of the view."""

    view: torch.Tensor
    pieces: int
    rows: bool  # the view's channels are (chunk, channel), else (channel, chunk)

    def per_channel(self, values: torch.Tensor) -> torch.Tensor:
        """``(C,)`` sums of the view's ``(C * pieces,)`` per-channel sums, added in float64."""
        if self.pieces == 1:
            return values
        shape = (self.pieces, -1) if self.rows else (-1, self.pieces)
        summed = values.view(shape).sum(0 if self.rows else 1, dtype=torch.float64)
        return summed.to(values.dtype)

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """A ``(C,)`` vector for the view's ``(C * pieces,)`` channels."""
        if self.pieces == 1:
            return values
        return values.repeat(self.pieces) if self.rows else values.repeat_interleave(self.pieces)


def _in_chunks(x: torch.Tensor) -> _Chunks:
    """``x`` viewed with each channel split into chunks: planes of more than
    :data:`_PLANE_LIMIT` values (contiguous data), or more than :data:`_ROWS_LIMIT` rows
    (``(N, C)``, channels last), in chunks of at most :data:`_PLANE_CHUNK` values or
    :data:`_ROWS_CHUNK` rows; on the CPU only.

    The CPU's batch-norm reductions accumulate float32 in float32, sequentially per
    channel, so their error grows with the values per channel: a ``(1, 2, 128, 128, 128)``
    volume's output was 5e-5 off, torch's BatchNorm (which accumulates its statistics in
    float64) 6e-8 (a review, 2026-12-06). Chunks cut each accumulation short; their sums
    are added in float64. Elsewhere (CUDA reduces in a tree), for float64, or for layouts
    and sizes that do not split evenly, the tensor as it is.
    """
    unchanged = _Chunks(x, 1, False)
    if x.dim() < 2 or x.numel() <= x.shape[1] * _ROWS_LIMIT:  # no channel holds that many
        return unchanged
    if x.device.type != "cpu" or x.dtype == torch.float64:
        return unchanged
    format = dense_format(x)
    if format is None:
        return unchanged
    channels = x.shape[1]
    rows = None  # rows of C values in memory: (N, C), or channels last
    if x.dim() == 2:
        rows = x
    elif format is not torch.contiguous_format:
        rows = x.permute(*reversed(_CHANNELS_LAST_ORDER[x.dim()]))
    # (sizes only: indexing would cost every call two aten calls)
    length = x.numel() // channels if rows is not None else math.prod(x.shape[2:])
    limit, chunk = (_ROWS_LIMIT, _ROWS_CHUNK) if rows is not None else (_PLANE_LIMIT, _PLANE_CHUNK)
    if length <= limit:
        return unchanged
    smallest = -(-length // chunk)
    count = next((k for k in range(smallest, 4 * smallest) if length % k == 0), None)
    if count is None:
        return unchanged
    if rows is not None:  # viewed as rows of pieces * C values
        return _Chunks(rows.view(-1, count * channels), count, True)
    return _Chunks(x.view(x.shape[0], channels * count, length // count), count, False)


def _sums(centered: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel sum and sum of squares of ``centered``, in one pass of
    ``native_batch_norm_backward`` (see :func:`local_moments`), over :func:`_in_chunks`."""
    chunks = _in_chunks(centered)
    zeros, ones, empty = constants(chunks.view.shape[1], shift.dtype, shift.device)
    # weight 1, not None: CUDA's kernel needs a weight to return the weight gradient
    _, shifted_square_sum, shifted_sum = torch.ops.aten.native_batch_norm_backward(
        chunks.view, chunks.view, ones, zeros, ones, empty, empty, False, 0.0, [False, True, True]
    )
    return chunks.per_channel(shifted_sum), chunks.per_channel(shifted_square_sum)


def output_offset(
    shift: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``bias + (shift - mean) * scale`` of ``(C,)`` vectors, in float64 (``mean`` and
    ``scale`` are float64): the output is ``(x - shift) * scale`` plus this, which loses
    nothing to a large mean (the shift is one of the data's values)."""
    shifted = shift - mean
    # out of place: under torch.compile (syncbn._composite) this is differentiated
    return shifted * scale if bias is None else torch.addcmul(bias, shifted, scale)


def reuses_shifted_copy(input: torch.Tensor, moments: LocalMoments) -> bool:
    """Whether :func:`normalize` writes the output into the shifted copy, from the offset
    (float32 and float64 input, a non-empty batch); else it runs an eval-mode
    ``batch_norm`` with the saved statistics, and the caller need not compute an offset."""
    centered = moments.centered
    return centered is not None and centered.dtype == input.dtype


def normalize(
    input: torch.Tensor,
    moments: LocalMoments,
    saved: torch.Tensor,
    offset: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The normalized output ``(x - mean) / sqrt(var + eps) * weight + bias``.

    float32/float64: written into the shifted copy in place, as ``centered * scale +
    offset`` with ``offset = bias + (shift - mean) * scale`` (computed in float64 by the
    caller: :func:`output_offset`; two fused passes, where a single broadcasting
    ``addcmul`` is several times slower on CPU). Low precision or an empty batch: one
    eval-mode ``batch_norm`` with the saved statistics.

    With ``valid`` (``(N, 1, *)`` bool), padded positions of the output are zero: the
    shifted copy is zero there, and the offset is added where valid only (one ``addcmul_``
    instead of ``add_``). The output is then a new tensor: the shifted copy, zero at
    padded positions and finite, is what a masked backward takes as its input.

    Args:
        saved: the call's per-channel statistics in the statistics dtype
            (:attr:`syncbn._autograd.ForwardResult.saved`): mean, variance, scale, and a
            row that backward reads. Its mean row is read only by the ``batch_norm`` path
            (where it is the input's mean; a masked call that reuses the shifted copy saves
            ``mean - shift`` there).
        offset: ``(C,)`` :func:`output_offset` in the statistics dtype; ``None`` where
            :func:`reuses_shifted_copy` is false (it is not read then).
    """
    dtype = saved.dtype
    centered = moments.centered
    if centered is None or not reuses_shifted_copy(input, moments):
        mean, var, _, _ = saved.unbind()
        output = torch.batch_norm(
            input,
            None if weight is None else _vector(weight).to(dtype),
            None if bias is None else _vector(bias).to(dtype),
            mean,
            var,
            False,
            0.0,
            eps,
            False,
        )
        return output if valid is None else zero_padded(output, valid, inplace=True)
    if offset is None:
        raise ValueError("normalize: an output written into the shifted copy needs its offset")
    ndim = centered.dim()
    # the scale row, saved[2], in broadcast shape: one op where a select and a view are two
    scale = _sample_view(saved, saved.storage_offset() + 2 * saved.stride(0), ndim)
    offset = channel_view(offset, ndim)
    if valid is None:
        return centered.mul_(scale).add_(offset)
    return torch.mul(centered, scale).addcmul_(valid, offset)


def _vector(tensor: torch.Tensor) -> torch.Tensor:
    """A per-channel tensor as a ``(C,)`` vector: a 0-dim weight or bias of one channel,
    which torch's kernel refuses for an empty batch (where it runs after the collective,
    and must not raise), becomes a view of one value."""
    return tensor if tensor.dim() == 1 else tensor.reshape(-1)


def backward_reduce(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local per-channel ``sum(dy)`` and ``sum(dy * xhat)``.

    Here ``xhat = (x - mean) / sqrt(var + eps)``.

    Both come from one fused pass of ``native_batch_norm_backward`` in eval mode, which
    returns exactly these sums as the bias and weight gradients.

    Low-precision data (float16, bfloat16) off the CPU is summed from float32 copies: torch's
    CUDA kernel accumulates such data in its own dtype (torch 2.11 on an H200, 2026-12-04:
    a bfloat16 bias gradient 0.1855 against the exact 0.1213, where float32 copies of the
    same data, and the CPU kernel, are exact; ``benchmarks/gpu_probe.py``). The copies cost
    two conversion passes; the CPU kernel accumulates in float32 and takes the data as is.

    Returns:
        ``(sum_dy, sum_dy_xhat)`` in the statistics dtype, shape ``(C,)``.
    """
    if input.numel() == 0:
        zeros = mean.new_zeros(mean.shape)
        return zeros, zeros.clone()
    grad_output = _laid_out_like(grad_output, input)
    # low precision: data whose statistics dtype is wider than its own
    if grad_output.device.type != "cpu" and stat_dtype(grad_output.dtype) != grad_output.dtype:
        grad_output, input = grad_output.to(mean.dtype), input.to(mean.dtype)
    chunks = _in_chunks(input)
    if chunks.pieces > 1:
        grad_chunks = _in_chunks(grad_output)
        if grad_chunks[1:] == chunks[1:] and grad_output.stride() == input.stride():
            grad_output, input = grad_chunks.view, chunks.view
            mean, var = chunks.spread(mean), chunks.spread(var)
        else:  # (layouts that differ are summed whole)
            chunks = _Chunks(input, 1, False)
    _, ones, empty = constants(mean.numel(), mean.dtype, mean.device)
    # weight 1, not None: CUDA's kernel needs a weight to return the weight gradient
    _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
        grad_output, input, ones, mean, var, empty, empty, False, eps, [False, True, True]
    )
    return chunks.per_channel(sum_dy), chunks.per_channel(sum_dy_xhat)


def _laid_out_like(grad_output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """``grad_output``, copied into ``input``'s strides where its own differ (and it is
    not expanded, as the gradient of ``output.sum()`` is).

    torch's CPU ``native_batch_norm_backward`` returns wrong sums for an output gradient
    laid out otherwise where a size-1 dimension makes the layouts hard to tell apart: a
    contiguous ``(2, 3, 1, 5)`` input with a gradient of strides ``(15, 1, 1, 3)`` (channels
    last, its size-1 dimension's stride 1) gave gradients 6.4 off, with torch's BatchNorm
    too (a fuzzer, 2026-12-07). Gradients laid out as the input (the usual case), an
    expanded one, and any layout of an input without a size-1 dimension (a transposed
    ``(N, L, C)`` batch with a contiguous gradient, say) the kernel reads right: they pass
    as they are, with no copy.
    """
    strides, input_strides = grad_output.stride(), input.stride()
    if strides == input_strides or 1 not in input.shape:  # (no ambiguity, no such error)
        return grad_output
    sizes = input.shape
    if all(a == b or size == 1 for size, a, b in zip(sizes, strides, input_strides)):
        return grad_output  # the same layout: only size-1 dimensions' strides differ
    if any(stride == 0 and size > 1 for size, stride in zip(sizes, strides)):
        return grad_output  # expanded
    return torch.empty_like(input, dtype=grad_output.dtype).copy_(grad_output)


def input_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    saved: torch.Tensor,
    eps: float,
    totals: torch.Tensor,
    count: int | torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Input gradient of batch normalization given the *global* reductions.

    .. math::
        dx = \gamma \sigma^{-1} \left(dy - \overline{dy} - \hat{x}\,\overline{dy\,\hat{x}}\right),
        \qquad \hat{x} = (x - \mu)\,\sigma^{-1}, \quad \sigma = \sqrt{var + \epsilon}

    computed in two fused passes: an eval-mode ``batch_norm`` of ``x`` with weight
    :math:`-\gamma\sigma^{-1}\overline{dy\,\hat{x}}` and bias
    :math:`-\gamma\sigma^{-1}\overline{dy}` gives the last two terms, and one
    ``addcmul_`` adds :math:`\gamma\sigma^{-1} dy`. Keeps the input's memory format. The
    means are the global sums times the saved row :math:`-\gamma\sigma^{-1} / n`.

    A masked call (``valid``) computes ``dy * s + x * a + valid * b`` in place in
    ``grad_output`` instead (three simple passes and no new tensor, ~40% less time on CPU
    than the eval-mode ``batch_norm``, its ``addcmul_`` and a zeroing pass): zero at padded
    positions, where both ``dy`` and ``x`` are. Its ``x`` is the forward's shifted copy,
    whose mean is small, so ``x * a + b`` cancels nothing. In low precision (the input's
    dtype differs from the statistics dtype, and ``x`` is the raw input) it takes the
    passes above and zeroes their result.

    Args:
        saved: :attr:`syncbn._autograd.ForwardResult.saved`: the forward's mean, variance,
            scale :math:`\gamma\sigma^{-1}`, and :math:`-\gamma\sigma^{-1} / n`.
        totals: ``(2, C)``: the global ``sum(dy)`` and ``sum(dy * xhat)``.
        count: the global count per channel ``n``, a number or a 0-dim tensor on the device
            (for kernels that divide by it themselves; these read the saved row).
        valid: ``(N, 1, *)`` bool, True at the valid positions of a masked call, or
            ``None``. With it, ``grad_output`` is zero at padded positions and this call's
            to overwrite (backward's zeroed copy of the output gradient), and ``input``
            is zero there too (:func:`syncbn._autograd.backward_input`).
    """
    correction_scale = saved[3]
    corrections = totals.to(correction_scale.dtype).mul_(correction_scale)
    return corrected_input_grad(grad_output, input, saved, eps, corrections, valid)


def corrected_input_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    saved: torch.Tensor,
    eps: float,
    corrections: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`input_grad` given its corrections: ``(2, C)`` in the statistics dtype, the
    global ``sum(dy)`` and ``sum(dy * xhat)`` times ``saved``'s last row (the means that
    the gradient subtracts, times :math:`-\\gamma\\sigma^{-1}`)."""
    mean, var, scale, _ = saved.unbind()
    correction_bias, correction_weight = corrections.unbind()
    ndim = input.dim()
    if valid is not None and in_place_masked(grad_output, input, saved):
        # batch_norm(x, w, b, mean, var) is x * a + (b - a * mean) with a = w / sqrt(var + eps)
        slope = correction_weight * (var + eps).rsqrt()
        offset = torch.addcmul(correction_bias, slope, mean, value=-1)
        return masked_input_grad(grad_output, input, scale, slope, offset, valid)
    gradient_dtype = grad_output.dtype  # the input gradient's too
    low_precision = scale.dtype != gradient_dtype
    if low_precision:
        # both terms in the statistics dtype, rounded once at the end as torch's kernels
        # round: the correction rounded to bfloat16 before the sum lost the difference of
        # two nearly equal terms (a review: an input gradient 25 % off where torch's is
        # 0.2 %). The output gradient goes into the float32 addcmul_ below as it is: type
        # promotion converts it exactly, on the CPU into a temporary (the same time as
        # converting first, 2026-12-08, torch 2.13), on a GPU in the kernel (no pass of
        # its own); into a low-precision result it was 2x slower
        input = input.to(scale.dtype)
    correction = torch.batch_norm(
        input, correction_weight, correction_bias, mean, var, False, 0.0, eps, False
    )
    grad_input = correction.addcmul_(grad_output, channel_view(scale, ndim))
    if low_precision:
        grad_input = grad_input.to(gradient_dtype)
    return grad_input if valid is None else zero_padded(grad_input, valid, inplace=True)


def in_place_masked(grad_output: torch.Tensor, input: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether a masked call's input gradient is :func:`masked_input_grad`'s three passes
    in the zeroed output gradient: when the gradient, the backward's input and the saved
    statistics share one dtype (else it takes :func:`corrected_input_grad`'s other passes
    and is zeroed after them)."""
    return input.dtype == grad_output.dtype == saved.dtype


def masked_input_grad(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    scale: torch.Tensor,
    slope: torch.Tensor,
    offset: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor:
    """``dy * scale + x * slope + valid * offset`` in place in ``grad_output`` (zero at
    padded positions, where both ``dy`` and ``x`` are): a masked call's input gradient
    (see :func:`input_grad`), given the per-channel ``(C,)`` ``slope`` and ``offset`` of
    its corrections (``slope = correction_weight / sqrt(var + eps)`` and
    ``offset = correction_bias - slope * mean``)."""
    ndim = input.dim()
    return (
        grad_output.mul_(channel_view(scale, ndim))
        .addcmul_(input, channel_view(slope, ndim))
        .addcmul_(valid, channel_view(offset, ndim))
    )
