"""The optimizers a user would pick instead of halfadam ("peers"), for ``halfadam train/bench --peers``.

Each :class:`Peer` names its mode, its package and class, how to build its optimizer and the state it
keeps. None is a dependency of halfadam: a peer runs only when its package is installed (otherwise
:func:`select` prints one line and skips it), and only when asked for (``--peers``, or its name in
``halfadam train --modes``). Every peer gets the hyperparameters of the other modes: torch's AdamW
defaults ``betas=(0.9, 0.999)``, ``eps=1e-8``, and decoupled weight decay ``w <- w * (1 - lr * wd)``.

State bytes are counted by :func:`tensor_parts`: a tensor subclass (torchao's ``OptimState8bit``)
reports the dtype it poses as (bfloat16, so ``numel * element_size`` says 2 bytes per element), not
what it stores (uint8 codes, float32 block scales and a float32 code table), so its inner tensors
are counted instead.

torch is imported only where a peer is built, probed or measured (``halfadam --help`` does not load it).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

__all__ = ["PEERS", "Peer", "installed", "select", "tensor_parts"]


@dataclass(frozen=True)
class Peer:
    """One peer optimizer: its mode name, where it comes from, and how to build it."""

    name: str  # the mode / row name, e.g. "bf16-optimi-kahan"
    package: str  # the pip package, e.g. "torch-optimi"
    module: str  # the top-level import name, e.g. "optimi"
    source: str  # the class, e.g. "optimi.AdamW(kahan_sum=True)"
    description: str  # what it is and the state it keeps
    build: Callable[..., torch.optim.Optimizer]  # build(params, *, lr, weight_decay)
    dtype: str = "bfloat16"  # the parameters' dtype, a torch attribute name (torch is imported on use)
    probe: bool = False  # try one step on a small tensor before using it (it may not run here)
    bench_only: bool = False
    cuda_only: bool = False  # runs as itself only on CUDA tensors: skipped elsewhere, with one line
    row: str = ""  # its ``halfadam bench`` row where the name's tail would repeat another peer's

    @property
    def param_dtype(self) -> torch.dtype:
        """The parameters' dtype (``torch.bfloat16`` for most)."""
        if not isinstance(self.dtype, str):  # a torch.dtype itself (docs/research's modes pass one)
            return self.dtype
        import torch

        return getattr(torch, self.dtype)

    @property
    def label(self) -> str:
        """The short name of its ``halfadam bench`` row (``optimi kahan``)."""
        return self.row or self.name.split("-", 1)[1].replace("-", " ")


_BETAS, _EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW's and halfadam.AdamW's defaults


def _optimi_kahan(params, *, lr, weight_decay):
    import optimi

    # Weight decay: optimi.AdamW with decouple_lr=False (its default) decays w <- w * (1 - lr * wd)
    # (optimi/adam.py: `weight_decay = 1 - lr * weight_decay`), torch.optim.AdamW's decoupled decay,
    # so wd passes through unchanged (decouple_lr=True would decay by (lr / max_lr) * wd instead).
    # optimi applies it with `param.mul_` on the bfloat16 weight, outside the Kahan compensation: a
    # factor 1 - lr * wd within half a bfloat16 ulp of 1 (lr * wd < ~2e-3) rounds away, as in naive bf16.
    # betas and eps are set to torch's defaults (optimi's own are (0.9, 0.99) and 1e-6).
    return optimi.AdamW(params, lr=lr, betas=_BETAS, eps=_EPS, weight_decay=weight_decay, kahan_sum=True)


def _torchao(*names: str, **extra):
    """A builder for the first class of ``names`` found in ``torchao.optim`` (torchao >= 0.11) or
    ``torchao.prototype.low_bit_optim`` (older)."""

    def build(params, *, lr, weight_decay):
        for module in ("torchao.optim", "torchao.prototype.low_bit_optim"):
            for name in names:
                cls = getattr(_try_import(module), name, None)
                if cls is not None:
                    # torchao compiles its step per parameter shape; its 8-bit state class warns at each compile.
                    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
                    # torchao decays w <- w - lr * wd * w in float32 (torchao/optim/adam.py), as torch's AdamW.
                    return cls(params, lr=lr, betas=_BETAS, eps=_EPS, weight_decay=weight_decay, **extra)
        raise ImportError(f"torchao has none of {', '.join(names)} in torchao.optim or torchao.prototype.low_bit_optim")

    return build


def _try_import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _bnb_8bit(params, *, lr, weight_decay):
    import bitsandbytes as bnb

    # bitsandbytes' AdamW decays p *= 1 - lr * wd (backends/*/ops.py), as torch's.
    return bnb.optim.AdamW8bit(params, lr=lr, betas=_BETAS, eps=_EPS, weight_decay=weight_decay)


def _deepspeed_cpu_adam(params, *, lr, weight_decay, **extra):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    # adamw_mode=True (the default) is decoupled decay, w -= lr * wd * w, as torch's.
    return DeepSpeedCPUAdam(params, lr=lr, betas=_BETAS, eps=_EPS, weight_decay=weight_decay, adamw_mode=True,
                            **extra)


def _deepspeed_cpu_adam_bf16(params, *, lr, weight_decay):
    # fp32_optimizer_states=False (DeepSpeed#8010, 2026-05; 0.19.8 has it) keeps exp_avg and exp_avg_sq in
    # the parameters' dtype: on bfloat16 parameters, bf16 moments and a bf16 master (no fp32 weights). Its
    # C++ op (csrc/adam/cpu_adam_impl.cpp) has a (BFloat16, BFloat16) invoker; it loads and stores bf16
    # through fp32 registers in its AVX-512 (or NEON) loop, and steps everything in a scalar loop on an AVX2-only
    # build (csrc/includes/cpu_adam.h). An older DeepSpeed has no such argument: its one-step probe fails with
    # a TypeError and the peer is skipped with one line.
    return _deepspeed_cpu_adam(params, lr=lr, weight_decay=weight_decay, fp32_optimizer_states=False)


def _te_fused_adam(params, *, lr, weight_decay):
    from transformer_engine.pytorch.optimizers import FusedAdam

    # adam_w_mode=True (its default) is decoupled decay, w -= lr * wd * w, as torch's. master_weights
    # with store_param_remainders: an fp32 master kept as the bf16 parameter plus a 16-bit remainder
    # (halfadam's "split"), fp32 moments: 10 B/param. CUDA only.
    return FusedAdam(params, lr=lr, betas=_BETAS, eps=_EPS, weight_decay=weight_decay, master_weights=True,
                     store_param_remainders=True)


def _flashoptim(params, *, lr, weight_decay):
    import flashoptim

    # FlashAdamW decays param *= 1 - lr * wd (decoupled, decouple_lr=False), as torch's AdamW. Its
    # default master_weight_bits=24: the bf16 parameter plus an int8 correction (rounded to nearest).
    return flashoptim.FlashAdamW(params, lr=lr, betas=_BETAS, eps=_EPS, weight_decay=weight_decay,
                                 master_weight_bits=24)


_PEER_LIST = [
    Peer("bf16-optimi-kahan", "torch-optimi", "optimi", "optimi.AdamW(kahan_sum=True)",
         "optimi.AdamW with Kahan summation on bfloat16 parameters, no master weights: bf16 exp_avg, "
         "exp_avg_sq and Kahan compensation (6 B/param)", _optimi_kahan),
    Peer("bf16-torchao-sr", "torchao", "torchao", "torchao.optim._AdamW(bf16_stochastic_round=True)",
         "torchao's AdamW with bf16 stochastic rounding on bfloat16 parameters, no master weights: bf16 "
         "exp_avg and exp_avg_sq (4 B/param)",
         # torchao 0.18 has no public AdamW: its README's bf16 stochastic-rounding AdamW is `_AdamW`.
         _torchao("_AdamW", "AdamW", bf16_stochastic_round=True)),
    Peer("bf16-torchao-8bit", "torchao", "torchao", "torchao.optim.AdamW8bit",
         "torchao.optim.AdamW8bit on bfloat16 parameters, no master weights, round to nearest: 8-bit "
         "block-quantized moments (uint8 codes, a float32 scale per 256 and a 1 KiB code table each: "
         "~2.03 B/param; a tensor under 4096 elements or not a multiple of 256 keeps bf16 moments, 4 B/param)",
         _torchao("AdamW8bit")),
    Peer("bf16-bnb-8bit", "bitsandbytes", "bitsandbytes", "bitsandbytes.optim.AdamW8bit",
         "bitsandbytes.optim.AdamW8bit on bfloat16 parameters, no master weights: 8-bit blockwise moments "
         "(uint8, a float32 absmax per 256, two shared code tables: ~2.03 B/param; tensors under 4096 "
         "elements keep float32 moments, 8 B/param)", _bnb_8bit, probe=True),
    # The CPU half of ZeRO-Offload: it steps the float32 master copy on the CPU (the bf16 weights live on
    # the GPU), so it is timed on float32 parameters and gradients.
    Peer("fp32-deepspeed-cpuadam", "deepspeed", "deepspeed", "deepspeed.ops.adam.DeepSpeedCPUAdam",
         "DeepSpeed's CPU Adam (ZeRO-Offload's optimizer) on float32 parameters: float32 moments (8 B/param)",
         _deepspeed_cpu_adam, dtype="float32", probe=True, bench_only=True),
    # ZeRO-Offload with bf16 optimizer states (DeepSpeed#8010): the host step on bf16 parameters, gradients
    # and moments, 14 B moved per parameter, no fp32 master.
    Peer("bf16-deepspeed-cpuadam", "deepspeed", "deepspeed",
         "deepspeed.ops.adam.DeepSpeedCPUAdam(fp32_optimizer_states=False)",
         "DeepSpeed's CPU Adam with bf16 optimizer states on bfloat16 parameters, no master: bf16 moments "
         "(4 B/param)", _deepspeed_cpu_adam_bf16, probe=True, bench_only=True,
         row="deepspeed cpuadam bf16-state"),
    Peer("bf16-te-fusedadam", "transformer-engine", "transformer_engine",
         "transformer_engine.pytorch.optimizers.FusedAdam(master_weights=True, store_param_remainders=True)",
         "Transformer Engine's FusedAdam on bfloat16 parameters (CUDA): fp32 master as the parameter plus a "
         "16-bit remainder, fp32 moments (10 B/param)", _te_fused_adam, probe=True, bench_only=True),
    # FlashOptim quantizes its state only for CUDA tensors (on the CPU it keeps float32 moments and no
    # correction), so on the CPU it would not be the optimizer it is: it runs on CUDA only.
    Peer("bf16-flashoptim", "flashoptim", "flashoptim", "flashoptim.FlashAdamW(master_weight_bits=24)",
         "FlashOptim's FlashAdamW on bfloat16 parameters (CUDA): a 24-bit master (the parameter plus an int8 "
         "correction, round to nearest), int8 exp_avg and uint8 sqrt(exp_avg_sq) codes with an fp16 scale "
         "per 32 (3.125 B/param)", _flashoptim, cuda_only=True),
]

#: Every peer by name, in the order they are added.
PEERS: dict[str, Peer] = {p.name: p for p in _PEER_LIST}


def installed(peer: Peer) -> bool:
    """Whether ``peer``'s package can be found (cheap: nothing is imported)."""
    return importlib.util.find_spec(peer.module) is not None


def _import(module: str) -> None:
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # torchao logs a warning per CUDA extension it cannot load
    try:
        importlib.import_module(module)
    finally:
        logging.disable(previous)


def _probe(peer: Peer, device: torch.device | str) -> None:
    """One step on a 4096-element tensor (the smallest that bitsandbytes steps in 8 bits); raises if it fails."""
    import torch

    p = torch.zeros(4096, dtype=peer.param_dtype, device=device, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    peer.build([p], lr=1e-3, weight_decay=0.0).step()


def select(names: list[str], *, add: bool, bench: bool = False, device: torch.device | str = "cpu",
           log: Callable[[str], None] | None = print) -> list[str]:
    """``names`` with the peers that can run here: every peer appended when ``add`` (``--peers``).

    A peer (named or added) whose package is missing, fails to import, needs CUDA where ``device`` is
    not (FlashOptim) or, for a probed peer, fails one step on ``device`` is left out with one line to
    ``log``. ``bench`` includes the bench-only peers.
    """
    import torch

    wanted = list(names)
    if add:
        wanted += [p.name for p in _PEER_LIST if (bench or not p.bench_only) and p.name not in wanted]
    out, ok = [], {}
    for name in wanted:
        peer = PEERS.get(name)
        if peer is None:
            out.append(name)
            continue
        if peer.module not in ok:
            try:
                _import(peer.module)
                ok[peer.module] = None
            except ImportError:
                ok[peer.module] = f"{peer.package} is not installed (pip install {peer.package})"
            except Exception as exc:  # an installed package that does not load against this torch
                ok[peer.module] = f"import {peer.module} failed: {type(exc).__name__}: {_first_line(exc)}"
        why = ok[peer.module]
        if why is None and peer.cuda_only and torch.device(device).type != "cuda":
            why = f"{peer.source} needs CUDA (it quantizes its state only for CUDA tensors), not {device}"
        if why is None and peer.probe:
            try:
                _probe(peer, device)
            except Exception as exc:
                why = f"one step of {peer.source} failed on {device}: {type(exc).__name__}: {_first_line(exc)}"
        if why is None:
            out.append(name)
        elif log is not None:
            log(f"--peers: skipped {name}: {why}")
    return out


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def tensor_parts(value) -> list[torch.Tensor]:
    """The plain tensors holding the data of a state entry ``value``: a tensor itself, a tensor
    subclass's inner tensors, or the tensors an object holds as attributes; ``[]`` for anything else.

    A wrapper subclass (torchao's ``OptimState8bit``: ``codes``, ``scale``, ``qmap``) is opened through
    ``__tensor_flatten__``, recursively. A plain object (FlashOptim's ``_MaybeQuantizedTensor``: int8
    codes and fp16 scales, or float32 data) is opened through its attributes, so the bytes counted are
    the bytes it stores.
    """
    import torch

    if isinstance(value, torch.Tensor):
        if not hasattr(type(value), "__tensor_flatten__"):
            return [value]
        names, _ = value.__tensor_flatten__()
        return [part for name in names for part in tensor_parts(getattr(value, name))]
    if hasattr(value, "__dict__") and not callable(value):
        return [part for v in vars(value).values() if isinstance(v, torch.Tensor) for part in tensor_parts(v)]
    return []
