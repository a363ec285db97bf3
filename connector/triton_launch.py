"""Direct launches of compiled Triton kernels for the injection path (DirectLauncher).

An injecting step launches one kernel from the HBM tier, and two per layer group (7 groups for
32 layers) from the host tier, each from Python before the forward can start. Triton's own
launch, `kernel[grid](...)`, binds and specialises every argument again on each call and looks
the compiled kernel up by that key. DirectLauncher keeps the CompiledKernel each first launch
returned, keyed by what Triton specialises on (each tensor argument's dtype and 16-byte
alignment, each specialised integer's value, the constexprs and launch options), and launches it
through `CompiledKernel[grid]`, the compiled kernel's own launcher, afterwards.

Hand-written because Triton has no public cached-launch API; the key is conservative (whole
integer values where Triton keeps only divisibility), so a cached kernel is only reused for
arguments it was compiled for. Off under the interpreter (TRITON_INTERPRET=1, the CPU tests) and
with KVMEM_TRITON_DIRECT_LAUNCH=0; tests/test_triton_inject.py compares both ways on a GPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def direct_launch_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") != "1" and os.environ.get("KVMEM_TRITON_DIRECT_LAUNCH", "1") != "0"


class DirectLauncher:
    """Launch `fn` (a @triton.jit function whose constexpr parameters come last) without re-binding."""

    def __init__(self, fn: Any, do_not_specialize: tuple[str, ...]) -> None:
        self.fn = fn
        self.kernels: dict[tuple, Any] = {}
        self.enabled = direct_launch_enabled() and hasattr(fn, "arg_names")  # not an interpreted function
        if not self.enabled:
            return
        names = list(fn.arg_names)
        self.constexpr_names = [p.name for p in fn.params if p.is_constexpr]
        runtime = [n for n in names if n not in self.constexpr_names]
        if names[: len(runtime)] != runtime:
            raise ValueError(f"{names}: constexpr parameters must come after the runtime ones")
        self.not_specialised = {runtime.index(n) for n in do_not_specialize}

    def _key(self, args: tuple, constexprs: dict[str, Any], options: dict[str, Any]) -> tuple:
        spec: list[Any] = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                spec.append((a.dtype, a.device.index, a.data_ptr() % 16 == 0))
            elif isinstance(a, bool) or (isinstance(a, int) and i not in self.not_specialised):
                spec.append(a)
            elif isinstance(a, int):  # unspecialised, but its integer type still follows its range
                spec.append("i32" if -(2**31) <= a < 2**31 else "i64" if -(2**63) <= a < 2**63 else "u64")
            else:  # floats, None
                spec.append(type(a))
        return (tuple(spec), tuple(constexprs[n] for n in self.constexpr_names), tuple(sorted(options.items())))

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any], **options: Any) -> None:
        if not self.enabled:
            self.fn[grid](*args, **constexprs, **options)
            return
        key = self._key(args, constexprs, options)
        kernel = self.kernels.get(key)
        if kernel is None:  # Triton's own launch: compiles (or finds) the kernel and returns it
            compiled = self.fn[grid](*args, **constexprs, **options)
            if compiled is not None:
                self.kernels[key] = compiled
            return
        stream = torch.cuda.current_stream(args[0].device).cuda_stream
        kernel[grid](*args, *(constexprs[n] for n in self.constexpr_names), stream=stream)
