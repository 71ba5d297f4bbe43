"""Flat storage for the optimizer state, and the per-parameter views on top of it.

A :class:`Bucket` holds the parameters of one parameter group that share a device, a dtype and a
master-weight setting, in the group's order (which is ``order_params`` order when given). Their
state (in the optimizer's :class:`halfadam.encodings.StateFormat`) and ``step`` counts live in
contiguous buffers, laid out parameter after parameter, and each parameter's ``optimizer.state[param]``
entries are views into them: a kernel sees one buffer per quantity, while ``state_dict``,
checkpoints and user code see ordinary per-parameter tensors of the usual shapes and dtypes.

Which parameters are bucketed: float32 parameters (updated through a flat scratch copy) and
float16/bfloat16 parameters with master weights, that require a gradient. float64 parameters,
half-precision parameters whose master weights are off and frozen parameters (``requires_grad=False``:
a LoRA base model, a partial fine-tune) keep separately allocated state, created only if they ever
get a gradient, and take the reference path; frozen parameters thus cost no memory in buckets.
"""

from __future__ import annotations

import operator
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import encodings
from ._dtensor import is_dtensor
from .encodings import BLOCK, StateFormat

__all__ = ["Bucket", "bucket_key", "build_buckets"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)

def bucket_key(param: Tensor, use_master: bool, fmt: StateFormat = StateFormat()
               ) -> Optional[Tuple[torch.device, torch.dtype, bool, StateFormat]]:
    """The bucket a parameter belongs to, or ``None`` if it keeps separately allocated state.

    Parameters of one bucket share a device, a dtype, a master setting and the format that applies
    to them (:func:`halfadam.encodings.for_param`: a 1-D parameter keeps float32 fields where ``fmt``
    has per-block ones). DTensor parameters (FSDP2) keep
    per-parameter DTensor state, sharded like the parameter, so that ``torch.distributed.checkpoint``
    saves it sharded; their update runs on local shards.
    """
    if is_dtensor(param) or not param.requires_grad:
        return None
    if param.dtype == torch.float32 or (param.dtype in _HALF_DTYPES and use_master):
        return (param.device, param.dtype, bool(use_master), encodings.for_param(fmt, param, use_master))
    return None


class Bucket:
    """Flat buffers for a list of parameters (one group, device, dtype, master setting), in a state format.

    Attributes:
        params: the parameters, in layout order.
        numels, offsets: element counts and start offsets of each parameter in the flat per-element
            buffers; with a blocked format (:attr:`halfadam.encodings.StateFormat.blocked`) each
            parameter starts at a multiple of ``BLOCK`` and ``sizes`` (its numel rounded up) leaves zero
            padding after it.
        row_lengths: the elements of each parameter's rows of blocks
            (:func:`halfadam.encodings.kernel_row_length`: its rows' where the format has per-block keys,
            else its numel: blocks over the flat parameter). A row
            is cut into blocks of ``BLOCK``, its last one shorter where the length is no multiple of it.
        block_counts, block_offsets: each parameter's blocks and its first block's index in the flat
            per-block buffers.
        flat: the state's flat buffers by key (:func:`halfadam.encodings.element_keys`, ``numel``
            long; :func:`~halfadam.encodings.block_keys`, one entry per block). Without a master
            (float32 parameters) the parameter itself is the weight.
        steps: float32 tensor of ``len(params)`` step counts; ``state[p]["step"]`` is a 0-d view.
        out: flat buffer of the parameters' dtype the kernel writes the new values of small
            parameters into (then copied into the parameters, whose storage is never changed);
            allocated on first use (large parameters are written directly).
    """

    def __init__(self, params: List[Tensor], use_master: bool, fmt: StateFormat = StateFormat(),
                 steps_on_device: bool = False):
        self.params = list(params)
        self.device = params[0].device
        self.dtype = params[0].dtype
        self.format = encodings.for_param(fmt, params[0], use_master)
        self.has_master = bool(use_master)
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        align = BLOCK if self.format.blocked else 1
        self.sizes = [-(-n // align) * align for n in self.numels]
        self.offsets = []
        total = 0
        for n in self.sizes:
            self.offsets.append(total)
            total += n
        self.numel = total
        self.row_lengths = [encodings.kernel_row_length(self.format, tuple(s), self.has_master) for s in self.shapes]
        self.block_counts = [encodings.blocks_in_rows(n, length) for n, length in zip(self.numels, self.row_lengths)]
        self.block_offsets = [sum(self.block_counts[:i]) for i in range(len(params))]
        on = dict(device=self.device)
        self.flat: Dict[str, Tensor] = {
            key: torch.zeros(total, dtype=dt, **on) for key, dt in encodings.element_keys(self.format, self.has_master).items()}
        self.flat.update({key: torch.zeros(sum(self.block_counts), dtype=dt, **on)
                          for key, dt in encodings.block_keys(self.format, self.has_master).items()})
        # each block's index within its parameter: the stochastic rounding's positions (encodings.positions),
        # for the parameters whose blocks are whole (the others step in their padded layout: has_tails)
        self.block_index: Optional[Tensor] = None
        if self.format.stochastic:
            self.block_index = torch.cat([torch.arange(n // BLOCK, dtype=torch.int32) for n in self.sizes]).to(**on)
        # CPU, as torch's "step"; on the parameters' device for capturable=True (as torch's)
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=self.device if steps_on_device else "cpu")
        self._uniform_at: Optional[int] = None  # steps._version at which the step counts were all equal
        self._out: Optional[Tensor] = None
        self._grad_buffers: Dict[torch.dtype, Tensor] = {}
        self._views: Dict[int, List[Tensor]] = {}
        self._attached: List[Optional[Tuple[Tensor, ...]]] = [None] * len(params)  # attach's views of _keys
        self._keys = ("step", *self.flat)
        #: what a kernel keeps between steps (the Triton kernel's work lists and tensor table)
        self.kernel_cache: Dict[object, object] = {}

    def steps_uniform(self, indices: Optional[List[int]] = None) -> bool:
        """Whether the step counts of parameters ``indices`` (default: all) are equal; for all of them,
        checked once per change of ``steps``."""
        if indices is not None:
            steps = self.steps[indices]
            return bool((steps == steps[0]).all())
        version = self.steps._version
        if self._uniform_at != version:
            if not bool((self.steps == self.steps[0]).all()):
                return False
            self._uniform_at = version
        return True

    def advance_steps(self, indices: Optional[List[int]] = None) -> None:
        """Add 1 to the step count of parameters ``indices`` (default: all, which keeps them uniform)."""
        if indices is None:
            uniform = self._uniform_at == self.steps._version
            self.steps.add_(1)
            if uniform:
                self._uniform_at = self.steps._version
        else:
            self.steps[indices] += 1

    @property
    def out(self) -> Tensor:
        if self._out is None:
            self._out = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return self._out

    def scratch_buffers(self) -> List[Tensor]:
        """The flat scratch buffers allocated so far (gradient gathering, parameter output)."""
        return list(self._grad_buffers.values()) + ([] if self._out is None else [self._out])

    def view(self, flat: Tensor, i: int) -> Tensor:
        """Parameter ``i``'s view of a flat per-element buffer, in the parameter's shape."""
        return flat[self.offsets[i]:self.offsets[i] + self.numels[i]].view(self.shapes[i])

    def block_view(self, flat: Tensor, i: int) -> Tensor:
        """Parameter ``i``'s view of a flat per-block buffer, of :func:`halfadam.encodings.block_shape`."""
        return flat[self.block_offsets[i]:self.block_offsets[i] + self.block_counts[i]].view(
            encodings.block_shape(tuple(self.shapes[i])))

    def has_tails(self, i: int) -> bool:
        """Whether parameter ``i``'s rows end in short blocks (its flat state is then not whole blocks)."""
        return encodings.has_short_blocks(self.numels[i], self.row_lengths[i])

    def state_views(self, i: int) -> Dict[str, Tensor]:
        """Parameter ``i``'s views of every flat buffer, by key (its shapes: the parameter's, or
        :func:`halfadam.encodings.block_shape`)."""
        return {key: self.block_view(flat, i) if encodings.is_block_key(key) else self.view(flat, i)
                for key, flat in self.flat.items()}

    def views(self, flat: Tensor) -> List[Tensor]:
        """Every parameter's view of ``flat`` (one of this bucket's per-element buffers; cached)."""
        cached = self._views.get(id(flat))
        if cached is None:
            cached = self._views[id(flat)] = [self.view(flat, i) for i in range(len(self.params))]
        return cached

    def segment(self, i: int, j: int) -> Dict[str, Tensor]:
        """The flat buffers' slices for parameters ``i:j`` (none of them :meth:`has_tails`), with the
        blocks' indices in their parameters (``encodings.BLOCK_INDEX``) when the format draws random bits."""
        a, b = self.offsets[i], self.offsets[j - 1] + self.sizes[j - 1]
        c, d = self.block_offsets[i], self.block_offsets[j - 1] + self.block_counts[j - 1]
        stored = {k: t[c:d] if encodings.is_block_key(k) else t[a:b] for k, t in self.flat.items()}
        if self.block_index is not None:
            stored[encodings.BLOCK_INDEX] = self.block_index[a // BLOCK:b // BLOCK]
        return stored

    def attach(self, state: dict, i: int) -> None:
        """Point ``state`` (parameter ``i``'s state dict) at views of the flat buffers.

        Values already present in ``state`` (for example loaded by ``load_state_dict``, or put there by
        the user; of the views' shapes: :meth:`halfadam.state.ParamStates.check_state`) are copied into
        the buffers first; missing ones are initialised (master from the parameter, zero moments,
        remainders and step).
        """
        param = self.params[i]
        if "step" in state:
            self.steps[i].copy_(state["step"].reshape(()) if isinstance(state["step"], Tensor) else state["step"])
        else:
            self.steps[i].zero_()
        state["step"] = self.steps[i]
        for key, v in self.state_views(i).items():
            if key in state:
                v.copy_(state[key])
            elif key == "master_weight":
                v.copy_(param.detach())
            else:
                v.zero_()
            state[key] = v
        self._attached[i] = tuple(state[key] for key in self._keys)

    def is_attached(self, state: dict, i: int) -> bool:
        """Whether every key of ``state`` is still the view :meth:`attach` put there, and ``state`` holds
        no other: none replaced by a load (``ZeroRedundancyOptimizer.load_state_dict`` puts new dicts) or
        by the user (``opt.state[p]["exp_avg_sq"] = torch.zeros_like(...)``), whose value the next step
        then starts from, none deleted or added. By identity: checked every step for every parameter."""
        attached = self._attached[i]
        return (attached is not None and len(state) == len(attached)
                and all(map(operator.is_, map(state.get, self._keys), attached)))

    def grad_buffer(self, dtype: torch.dtype) -> Tensor:
        """A flat scratch buffer of ``dtype`` for gathering this bucket's gradients (padding stays zero)."""
        buf = self._grad_buffers.get(dtype)
        if buf is None:
            buf = self._grad_buffers[dtype] = torch.zeros(self.numel, dtype=dtype, device=self.device)
        return buf


def build_buckets(params: List[Tensor], use_master: List[bool], fmt: StateFormat = StateFormat(),
                  steps_on_device: bool = False) -> List[Bucket]:
    """Split ``params`` (in order) into buckets by :func:`bucket_key`, keeping their order."""
    groups: Dict[tuple, List[Tensor]] = {}
    for p, m in zip(params, use_master):
        key = bucket_key(p, m, fmt)
        if key is not None:
            groups.setdefault(key, []).append(p)
    return [Bucket(ps, key[2], fmt, steps_on_device) for key, ps in groups.items()]
