"""The per-tensor step on the gradient's device: error feedback, selection, sums.

On a GPU, copying a whole gradient bucket to the host costs more than the network
saves. :class:`DeviceSelector` keeps the residuals on the tensors' device and runs
error feedback, the sparsifier, the residual update and the sums of the ranks'
decoded pairs there as torch operations; only the selected indices and values go
to the host codecs, and only decoded pairs come back, all through one
:class:`HostLink`, which counts the bytes.

It serves the allgather communicator with exact index codecs (the Bloom filters'
false positives would need values from the whole tensor) and every sparsifier.
On CPU tensors it selects the same sets, codes the same payload bytes and leaves
bit-identical residuals and sums as the numpy path (:class:`deepreduce.exchange.selection.Selector`):
TopK keeps exactly k with ties to the lowest positions, RandomK draws its
positions from the same numpy stream, fp16 and bf16 round as the codecs do.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch

from deepreduce.exchange.memory import ResidualMemory
from deepreduce.exchange.selection import Selection, Selector
from deepreduce.sparse import BFLOAT16, SparseTensor
from deepreduce.sparsifiers import BlockTopK, NonZero, RandomK, Threshold, TopK, _count
from deepreduce.torch.streams import used_on_current_stream

#: Value codecs whose loss is a cast, which the device repeats to know what the
#: receivers decode without a copy back from the host.
_CASTS = {"raw": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def host_array(tensor) -> np.ndarray:
    """A numpy view of the CPU tensor ``tensor`` (bfloat16 through ml_dtypes' type)."""
    if tensor.dtype == torch.bfloat16:
        if BFLOAT16 is None:
            raise TypeError("bfloat16 tensors need the ml_dtypes package (pip install "
                            "ml_dtypes) to be encoded")
        return tensor.view(torch.int16).numpy().view(BFLOAT16)
    return tensor.numpy()


def from_host(array: np.ndarray):
    """The CPU tensor sharing the memory of ``array`` (inverse of :func:`host_array`)."""
    if BFLOAT16 is not None and array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


class HostLink:
    """The one place where bytes cross between the host and a device; counts them.

    Attributes
    ----------
    to_host_bytes, to_device_bytes : int
        Bytes copied each way since the link was made (or :meth:`reset`).
    to_host_copies, to_device_copies : int
        Copies each way since then: on a GPU, each to the host waits for the device.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.to_host_bytes = self.to_device_bytes = 0
        self.to_host_copies = self.to_device_copies = 0

    def to_host(self, tensors) -> list[np.ndarray]:
        """Numpy arrays of the values of ``tensors`` (of one dtype), all in one copy: each
        copy to the host waits for the device."""
        if not tensors:
            return []
        flat = self._copy_to_host(torch.cat([tensor.reshape(-1) for tensor in tensors]))
        arrays, start = [], 0
        for tensor in tensors:
            arrays.append(host_array(flat[start:start + tensor.numel()]).reshape(tensor.shape))
            start += tensor.numel()
        return arrays

    def pairs_to_host(self, pairs) -> list[tuple]:
        """For each ``(positions, values, check)`` of ``pairs`` (``check``: a 0-d bool
        tensor on their device, or None), the same on the host: numpy arrays (int64
        positions) and a bool (True for None). All in one copy: a copy to the host waits
        for the device's work so far, and one wait serves them all."""
        chunks, layout = [], []
        for positions, values, check in pairs:
            parts = [positions.to(torch.int64).view(torch.uint8),
                     values.contiguous().view(torch.uint8)]
            if check is not None:
                parts.append(check.to(torch.uint8).view(1))
            for part in parts:  # each part from a multiple of 8 bytes: its view aligned
                chunks.append(part)
                if part.numel() % 8:
                    chunks.append(part.new_zeros(-part.numel() % 8))
            layout.append((positions.numel(), values.numel(), values.dtype, check is not None))
        if not chunks:
            return []
        flat, at, out = self._copy_to_host(torch.cat(chunks)), 0, []

        def take(count, dtype):
            nonlocal at
            nbytes = count * dtype.itemsize
            array = host_array(flat[at:at + nbytes].view(dtype))
            at += nbytes + -nbytes % 8
            return array

        for positions, values, dtype, checked in layout:
            out.append((take(positions, torch.int64), take(values, dtype),
                        not checked or bool(take(1, torch.uint8)[0])))
        return out

    def _copy_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        self.to_host_bytes += tensor.numel() * tensor.element_size()
        self.to_host_copies += 1
        return tensor.detach().cpu()

    def to_device(self, arrays, device) -> list[torch.Tensor]:
        """The numpy ``arrays`` (flat) as tensors on ``device``, those of one dtype in one
        copy. To a GPU the copies start from pinned memory and do not block: from the
        host's pageable memory, each would wait for the device."""
        tensors = [None] * len(arrays)
        pinned = torch.device(device).type == "cuda"
        for dtype in dict.fromkeys(array.dtype for array in arrays):
            chosen = [i for i, array in enumerate(arrays) if array.dtype == dtype]
            flat = from_host(np.concatenate([arrays[i].reshape(-1) for i in chosen]))
            self.to_device_bytes += flat.numel() * flat.element_size()
            self.to_device_copies += 1
            if pinned:  # (the pinned block is not reused before the copy is done)
                flat = flat.pin_memory()
            flat, start = flat.to(device, non_blocking=pinned), 0
            for i in chosen:
                tensors[i] = flat[start:start + arrays[i].size]
                start += arrays[i].size
        return tensors


class DeviceResidualMemory(ResidualMemory):
    """:class:`~deepreduce.ResidualMemory` whose residuals are torch tensors on the
    gradients' device (restored ones wait on the CPU until their first use)."""

    def accumulate(self, name: str, gradient) -> torch.Tensor:
        """``gradient + beta * residual``, made in the residual's memory (the gradient
        itself the first time). Host gradients (numpy, SparseTensor) take the numpy
        path, with their residuals on the host."""
        residual = self._residuals.get(name)
        if not isinstance(gradient, torch.Tensor):
            if isinstance(residual, torch.Tensor):  # restored from a checkpoint
                self._residuals[name] = host_array(residual.detach().cpu()).copy()
            return super().accumulate(name, gradient)
        if residual is None or self.beta == 0.0:
            return gradient
        if residual.shape != gradient.shape:
            raise ValueError(f"tensor {name!r} changed shape from {tuple(residual.shape)} "
                             f"to {tuple(gradient.shape)}; call reset({name!r}) first")
        if residual.device != gradient.device or residual.dtype != gradient.dtype:
            residual = self._residuals[name] = residual.to(gradient.device, gradient.dtype)
        if self.beta != 1.0:
            residual.mul_(self.beta)
        return residual.add_(gradient)

    def settle_at(self, name: str, corrected: torch.Tensor, positions: torch.Tensor,
                  selected: torch.Tensor, delivered: torch.Tensor) -> None:
        """The residual becomes ``corrected`` with ``selected - delivered`` at ``positions``
        (flat), in ``corrected``'s memory when it is the residual's, else in a copy."""
        residual = corrected if corrected is self._residuals.get(name) else corrected.clone()
        residual.view(-1)[positions] = selected - delivered.to(residual.dtype)
        self._residuals[name] = residual

    def pay(self, name: str, gradient):
        residual = self._residuals.get(name)
        if not isinstance(gradient, torch.Tensor) or not isinstance(residual, torch.Tensor):
            return super().pay(name, gradient)
        del self._residuals[name]
        if self.beta != 0.0:
            owed = residual if self.beta == 1.0 else self.beta * residual
            gradient += owed.to(gradient.device, gradient.dtype).reshape(gradient.shape)
        return gradient

    def restore(self, name: str, residual) -> None:
        self._residuals[name] = torch.as_tensor(np.array(residual, copy=True, order="C")) \
            if isinstance(residual, np.ndarray) else residual.detach().clone()


class DeviceSelection(Selection):
    """A :class:`~deepreduce.exchange.selection.Selection` made on the device: ``selected`` is on
    the host, ``positions`` and ``values`` are its device copies."""

    def __init__(self, name, pipeline, selected, corrected, positions, values):
        super().__init__(name, pipeline, selected, None, corrected)
        self.positions, self.values = positions, values


@dataclasses.dataclass
class _Proposal:
    """A tensor's selection on the device, before its pairs reach the host."""

    slot: int
    name: str | None
    pipeline: object
    corrected: torch.Tensor | None
    flat: torch.Tensor
    shape: tuple
    positions: torch.Tensor
    values: torch.Tensor
    exact: torch.Tensor | None

    def pair(self) -> tuple:
        return self.positions, self.values, self.exact


class DeviceSelector(Selector):
    """:class:`~deepreduce.exchange.selection.Selector` for torch tensors on any device.

    Host inputs (numpy arrays, SparseTensors: the small tensors, which travel
    losslessly) take the numpy path; torch tensors stay where they are.

    Parameters
    ----------
    config : ExchangeConfig
    link : HostLink, optional
        Where the bytes cross (a new one by default).
    """

    def __init__(self, config, link: HostLink | None = None):
        super().__init__(config)
        if self.memory is not None:
            self.memory = DeviceResidualMemory(self.memory.beta)
        self.link = HostLink() if link is None else link
        index, value = self.pipeline.index_codec, self.pipeline.value_codec
        if index is not None and not index.lossless:
            raise ValueError(f"the device path needs an exact index codec, got {index!r}: "
                             "its false positives would need the whole tensor's values")
        self._cast = _CASTS.get(value.get_config()["id"], False) \
            if index is not None else False

    def size(self, x) -> int:
        return x.numel() if isinstance(x, torch.Tensor) else super().size(x)

    def floating(self, x):
        return x if isinstance(x, torch.Tensor) else super().floating(x)

    def all_finite(self, tensors) -> bool:
        """As the numpy selector's, with the torch tensors checked where they live and
        the answer brought to the host once (a wait for the device)."""
        tensors = list(tensors)
        on_device = [x for x in tensors if isinstance(x, torch.Tensor)]
        host = [x for x in tensors if not isinstance(x, torch.Tensor)]
        return super().all_finite(host) and (
            not on_device or bool(torch.stack([tensor_finite(x) for x in on_device]).all()))

    def select(self, name, x, lossless: bool = False) -> Selection:
        if not isinstance(x, torch.Tensor):
            return super().select(name, x, lossless)
        if lossless:
            raise ValueError("small tensors travel from the host: hand them over as numpy "
                             "arrays")
        return self.select_all([(name, x)])[0]

    def select_all(self, requests) -> list[Selection]:
        """:meth:`select` of each ``(name, x)``; the selected pairs of all the tensors
        cross to the host in one copy, the one wait for the device of a step's
        selections (two in the rare step where a sampled Top-k threshold missed)."""
        selections, proposals = [], []
        for name, x in requests:
            if not isinstance(x, torch.Tensor):
                selections.append(super().select(name, x))
                continue
            if self.is_small(x):
                raise ValueError("small tensors travel from the host: hand them over as "
                                 "numpy arrays")
            pipeline = self.pipeline_of(name)
            corrected = None
            if self.memory is not None and name is not None:
                corrected = x = self.memory.accumulate(name, x)
            flat = x.reshape(-1)
            positions, exact = propose_on_device(pipeline.sparsifier, flat)
            proposals.append(_Proposal(len(selections), name, pipeline, corrected, flat,
                                       tuple(x.shape), positions, flat[positions], exact))
            selections.append(None)
        pairs = self.link.pairs_to_host([p.pair() for p in proposals])
        missed = [p for p, (_, _, exact) in zip(proposals, pairs) if not exact]
        for p in missed:  # the sampled threshold missed (rare): among all values
            p.positions = exact_top_k(p.pipeline.sparsifier, p.flat)
            p.values, p.exact = p.flat[p.positions], None
        again = iter(self.link.pairs_to_host([p.pair() for p in missed]))
        for p, (positions, values, exact) in zip(proposals, pairs):
            if not exact:
                positions, values, _ = next(again)
            selected = SparseTensor._trusted(values, positions, p.shape)
            selections[p.slot] = DeviceSelection(p.name, p.pipeline, selected, p.corrected,
                                                 p.positions, p.values)
        return selections

    def settle(self, selection: Selection, received: SparseTensor,
               selected: SparseTensor | None = None) -> None:
        if not isinstance(selection, DeviceSelection):
            return super().settle(selection, received, selected)
        self.settle_all([(selection, received)])

    def settle_all(self, settles) -> None:
        """:meth:`settle` of each ``(selection, received)``. What the receivers decode is
        the selection cast, or else comes from the host: the positions and values of
        every such tensor in one copy per dtype."""
        fetched = []
        for selection, received in settles:
            if isinstance(selection, DeviceSelection):
                # made on the producer's stream, used here on the communication thread's
                # (deepreduce.torch.streams): not to be reallocated before that use is done
                used_on_current_stream(selection.positions, selection.values,
                                       selection.corrected)
            if not isinstance(selection, DeviceSelection):
                super().settle(selection, received)
            elif selection.corrected is None:
                continue
            elif self._cast is False or received.nnz != selection.positions.numel() \
                    or selection.values.dtype == torch.float64:
                fetched.append((selection, received))
            else:  # what the receivers decode is the selection, cast: no copy back
                self.memory.settle_at(selection.name, selection.corrected,
                                      selection.positions, selection.values,
                                      _cast(selection.values, self._cast))
        if not fetched:
            return
        arrays = [a for _, received in fetched for a in (received.indices, received.values)]
        tensors = iter(self.link.to_device(arrays, fetched[0][0].values.device))
        for selection, _ in fetched:
            positions, delivered = next(tensors), next(tensors)
            current = selection.corrected.reshape(-1)[positions]
            self.memory.settle_at(selection.name, selection.corrected, positions, current,
                                  delivered)

    def sum_into_device(self, jobs) -> None:
        """For each ``(target, parts, scale)`` of ``jobs``, make ``target`` (a tensor on the
        device of them all, or a list of them: a shared payload's tensors, which receive
        the sum in slices, in order) the sum of the ranks' decoded ``parts`` times
        ``scale``: the same bits as :func:`deepreduce.sums.sum_sorted_into` (each rank added
        in turn in the accumulator's precision, scaled in double). The positions of every
        part cross in one copy, and their values in one per dtype: each copy from the
        host's pageable memory waits for the device."""
        parts = [part for _, job_parts, _ in jobs for part in job_parts]
        arrays = [a for part in parts for a in (part.indices, part.values)]
        device = _pieces(jobs[0][0])[0].device
        tensors = iter(self.link.to_device(arrays, device) if arrays else ())
        for target, job_parts, scale in jobs:
            pieces = _pieces(target)
            flat = target.view(-1) if pieces[0] is target else \
                pieces[0].new_empty(sum(piece.numel() for piece in pieces))
            accumulator = torch.float64 if flat.dtype == torch.float64 else torch.float32
            total = flat if flat.dtype == accumulator else \
                torch.zeros(flat.numel(), dtype=accumulator, device=flat.device)
            total.zero_()
            touched = []
            for _ in job_parts:  # (one rank after another: the host's order of additions)
                positions, values = next(tensors), next(tensors)
                total.index_add_(0, positions, values.to(accumulator))
                touched.append(positions)
            if scale is not None and touched:
                # every rank's positions, repeats included: each repeat reads the same sum
                # before any is written, and writes the same scaled value (a unique()
                # would wait for the device to size its result)
                touched = torch.cat(touched)
                total[touched] = (total[touched].double() * scale).to(accumulator)
            if total is not flat:
                flat.copy_(total)
            if pieces[0] is not target:  # a shared payload: each tensor's slice of the sum
                sizes = [piece.numel() for piece in pieces]
                for piece, part in zip(pieces, flat.split(sizes)):
                    piece.view(-1).copy_(part)

    def state_dict(self) -> dict:
        memory = self.memory
        residuals = {} if memory is None else {name: _copy(memory.residual(name))
                                               for name in memory.names()}
        return {"residuals": residuals, "random_state": self.random_state()}


def tensor_finite(x: torch.Tensor) -> torch.Tensor:
    """Whether the tensor ``x`` holds no inf or NaN, as a boolean tensor on its device
    (nothing waits for the device). As :func:`deepreduce.exchange.selection.all_finite`: a sum
    is finite only when every term is, so one read pass answers, and only a non-finite
    sum (finite terms may overflow it) is checked element by element."""
    if not x.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=x.device)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    finite_sum = torch.isfinite(x.sum(dtype=wide))
    if x.device.type == "cpu":  # no device to wait for: the exact check only when needed
        return finite_sum if finite_sum else torch.isfinite(x).all()
    return finite_sum | torch.isfinite(x).all()


def _pieces(target) -> list:
    """The tensors a job of :meth:`DeviceSelector.sum_into_device` writes: ``target``
    itself, or the tensors of a shared payload (``target`` is their list)."""
    return target if isinstance(target, list) else [target]


def _copy(residual):
    return residual.detach().clone() if isinstance(residual, torch.Tensor) else residual.copy()


def _cast(values: torch.Tensor, dtype) -> torch.Tensor:
    """What the value codec casting to ``dtype`` delivers of ``values`` (float32, float16
    or bfloat16): fp16 saturates finite values at +-65504 as its codec does."""
    if dtype is None or values.dtype == dtype:
        return values
    if dtype == torch.float16:
        values = torch.where(torch.isfinite(values), values.clamp(-65504.0, 65504.0), values)
    return values.to(dtype)


#: Tensors of this many values and more take TopK's sampled threshold first (the
#: numpy path's fast mode): the exact selection then runs on the candidates that reach
#: it, 1.6-2.8 k of them, instead of on every value. Smaller ones are selected among
#: all their values, which on a CPU costs about as much at 16K values
#: (``benchmarks/device_step.py`` measures the device path).
SAMPLED_FROM = 1 << 16


def select_on_device(sparsifier, flat: torch.Tensor) -> torch.Tensor:
    """Sorted flat positions that ``sparsifier`` (a deepreduce sparsifier) takes from
    ``flat``, computed on ``flat``'s device: the positions the numpy sparsifier takes."""
    positions, exact = propose_on_device(sparsifier, flat)
    if exact is not None and not bool(exact):  # (waits for the device)
        positions = exact_top_k(sparsifier, flat)
    return positions


def propose_on_device(sparsifier, flat: torch.Tensor):
    """``(positions, exact)``: :func:`select_on_device`'s positions without waiting for
    the device. ``exact`` is None when they are the sparsifier's for sure, else a 0-d
    bool tensor on the device that says whether they are: TopK from a sampled threshold
    (:data:`SAMPLED_FROM` values and more) knows it only once the candidates are
    counted, and when they are not, :func:`exact_top_k` gives them."""
    n = flat.numel()
    if isinstance(sparsifier, TopK):
        k = _count(sparsifier.ratio, sparsifier.k, n, "TopK")
        if SAMPLED_FROM <= n < 1 << 32 and 0 < k < n and flat.dtype != torch.float64:
            return _sampled_top_k(flat, k)
        return _largest(_magnitudes(flat), k), None
    return _select_exactly(sparsifier, flat), None


def exact_top_k(sparsifier: TopK, flat: torch.Tensor) -> torch.Tensor:
    """Sorted positions of :class:`~deepreduce.TopK`'s set, selected among all values."""
    return _largest(_magnitudes(flat), _count(sparsifier.ratio, sparsifier.k, flat.numel(),
                                              "TopK"))


def _select_exactly(sparsifier, flat: torch.Tensor) -> torch.Tensor:
    """:func:`select_on_device` for the sparsifiers other than TopK."""
    n = flat.numel()
    if isinstance(sparsifier, NonZero):
        return torch.nonzero(flat).view(-1)
    if isinstance(sparsifier, Threshold):
        values = flat.float() if flat.element_size() < 4 else flat
        return torch.nonzero((values > sparsifier.tau) | (values < -sparsifier.tau)).view(-1)
    if isinstance(sparsifier, RandomK):
        # the numpy stream draws the positions, as on the host: k integers to copy
        k = _count(sparsifier.ratio, sparsifier.k, n, "RandomK")
        drawn = np.sort(sparsifier._rng.choice(n, size=k, replace=False))
        return torch.from_numpy(drawn).to(flat.device)
    if isinstance(sparsifier, BlockTopK):
        block = sparsifier.block
        blocks = -(-n // block)
        padded = torch.zeros(blocks * block, dtype=torch.float64, device=flat.device)
        padded[:n] = flat.double()
        norms = padded.view(blocks, block).square().sum(dim=1)
        chosen = _largest(norms, math.ceil(sparsifier.ratio * blocks))
        positions = (chosen[:, None] * block
                     + torch.arange(block, device=flat.device)).view(-1)
        return positions[positions < n]
    raise TypeError(f"the device path has no implementation of {sparsifier!r}: use one of "
                    "deepreduce's sparsifiers (TopK, RandomK, Threshold, BlockTopK, None)")


def _magnitudes(values: torch.Tensor) -> torch.Tensor:
    """``|values|`` (float16/bfloat16 in float32), NaN ranked lowest as in numpy's TopK."""
    magnitudes = (values.float() if values.element_size() < 4 else values).abs()
    return torch.nan_to_num(magnitudes, nan=-math.inf, posinf=math.inf)


def _sampled_top_k(values: torch.Tensor, k: int):
    """``(positions, exact)`` of the ``k`` values of largest magnitude in the 1-D
    ``values`` (NaN ranked lowest, ties to the lowest positions), chosen among those
    that reach a sampled threshold (``exact``: whether they held the k)."""
    n = values.numel()
    low, most = _sampled_low(_magnitudes(values[sample_positions(n, values.device)]), k, n)
    reach = values.abs() >= low  # (NaN reaches no threshold: it ranks lowest)
    # room for one more than `most` candidates, padded with -1: no count to wait for,
    # where torch.nonzero would make the host wait for the device to know its size
    room = max(k, most) + 1
    candidates = _nonzero_padded(reach, room)
    if candidates is None:  # (a device without nonzero_static: they are counted now)
        candidates, exact = torch.nonzero(reach).view(-1), None
        if candidates.numel() < k:  # the sample misled: select among all
            return _largest(_magnitudes(values), k), None
    else:  # they held the top k when k of them were found and the last slot is padding
        exact = (candidates[k - 1] >= 0) & (candidates[room - 1] < 0)
    magnitudes = _magnitudes(values[candidates])
    # padding ranks below every candidate (a candidate's magnitude is a number)
    magnitudes = torch.where(candidates >= 0, magnitudes, -math.inf)
    chosen = _top_keys(magnitudes, candidates, n, k)
    return candidates[chosen].sort().values, exact


#: Device types whose torch has no ``nonzero_static`` (CUDA before torch 2.6).
_COUNTS_NONZERO: set = set()


def _nonzero_padded(mask: torch.Tensor, size: int) -> torch.Tensor | None:
    """The first ``size`` positions where ``mask`` holds, padded with -1, without a wait
    for the device; None where torch cannot."""
    if mask.device.type not in _COUNTS_NONZERO:
        try:
            return torch.nonzero_static(mask, size=size, fill_value=-1).view(-1)
        except (AttributeError, NotImplementedError):
            _COUNTS_NONZERO.add(mask.device.type)
    return None


def _largest(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted positions of the ``k`` largest ``magnitudes``, ties to the lowest positions
    (the rule of :func:`deepreduce.sparsifiers._largest`)."""
    n = magnitudes.numel()
    device = magnitudes.device
    if k >= n:
        return torch.arange(n, device=device)
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    if magnitudes.dtype == torch.float32 and n < 1 << 32:
        return _top_keys(magnitudes, torch.arange(n, device=device), n, k).sort().values
    kth = torch.topk(magnitudes, k, sorted=False).values.min()
    keep = magnitudes > kth
    missing = k - int(keep.sum())
    if missing:
        ties = torch.nonzero(magnitudes == kth).view(-1)[:missing]
        keep[ties] = True
    return torch.nonzero(keep).view(-1)


def _top_keys(magnitudes: torch.Tensor, positions: torch.Tensor, n: int, k: int):
    """Where the ``k`` largest of the float32 ``magnitudes`` at ``positions`` (of a
    tensor of ``n``) lie in ``magnitudes``, ties to the lowest positions."""
    # one key per value, its magnitude's order then its position's reverse: the k
    # largest keys are the k largest magnitudes with ties to the lowest positions
    bits = magnitudes.view(torch.int32).to(torch.int64)
    bits = torch.where(bits < 0, torch.zeros_like(bits), bits + 1)  # -inf (NaN) lowest
    return torch.topk((bits << 32) | (n - 1 - positions), k, sorted=False).indices


@functools.lru_cache(maxsize=256)
def sample_positions(n: int, device=None) -> torch.Tensor:
    """The positions of a tensor of ``n`` values whose magnitudes the device path's TopK
    samples: one in each of as many equal strata as the numpy path samples, scattered
    in them by a fixed multiplicative hash (the selected set never depends on them,
    only the candidates do). Kept per size and device (32 KB each, at most): a step
    samples the same tensors every time."""
    count = min(TopK.SAMPLE, max(TopK.MIN_SAMPLE, n >> 8))
    stride = n // count
    strata = torch.arange(0, count * stride, stride, device=device)
    return strata + (strata // stride * 0x9E3779B1) % stride


def _sampled_low(sample: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, int]:
    """``(low, most)``: a magnitude (a 0-d tensor on their device) that about ``k`` plus a
    safe margin of a tensor's ``n`` magnitudes reach, from the magnitudes ``sample`` of
    it (the rule of :class:`deepreduce.TopK`'s fast mode), and how many reach it at
    most, but with a chance far below one in a million."""
    count = sample.numel()
    expected = count * k / n
    j = min(count, int(expected + 4 * math.sqrt(expected) + 2))
    # j of the sample reach low: the tensor's share that does is about j / count, give
    # or take sqrt(j) / count
    most = min(n, math.ceil(n * (j + 6 * math.sqrt(j) + 6) / count))
    return torch.kthvalue(sample, count - j + 1).values, most  # the j-th largest
