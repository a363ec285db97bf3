"""Host tier of the GPU path: pin the arena's kv.bin in place and view it as a CUDA tensor.

The host tier is the arena's kv.bin (shared memory, authoritative). The engine worker registers
it with CUDA (cudaHostRegister, portable + mapped), so the GPU reads it over PCIe without a
bounce through pageable memory, and views it as a CUDA tensor: the copy kernel
(connector.triton_inject.copy_rows) reads host rows directly. Used by
connector.gpu_injector.GpuInjector.
"""

from __future__ import annotations

import ctypes
import logging
import time

import torch

logger = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
SLOW_PIN_S = 2.0  # a pin slower than this is reported as a warning (the engine's default log level)


def _device_pointer(host_ptr: int) -> int | None:
    """The device address of registered (mapped) host memory, or None when it cannot be read."""
    path = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcudart.so" in line:
                    path = line.split()[-1]
                    break
    except OSError:
        pass
    if path is not None:
        try:
            lib = ctypes.CDLL(path)
            out = ctypes.c_void_p()
            if lib.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0) == 0 and out.value:
                return int(out.value)
        except (OSError, AttributeError):
            pass
    try:
        from cuda.bindings import runtime as cudart  # cuda-python, where installed

        err, pointer = cudart.cudaHostGetDevicePointer(host_ptr, 0)
        if int(err) == 0:
            return int(pointer)
    except Exception:  # noqa: BLE001 - optional dependency, any failure means "unknown"
        pass
    return None


class _CudaArrayInterface:
    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def pin_host_tensor(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """Register `host` (contiguous CPU tensor) with CUDA and return a CUDA view of the same bytes.

    Returns None (logged) where registration or mapping fails; the caller then copies through
    pageable memory instead.
    """
    if not host.is_contiguous():
        raise ValueError("only a contiguous tensor can be pinned in place")
    nbytes = host.numel() * host.element_size()
    started = time.perf_counter()
    try:
        rc = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED))
    except Exception as exc:  # noqa: BLE001
        logger.warning("cudaHostRegister unavailable (%s); the host tier is copied through pageable memory", exc)
        return None
    if rc not in (0, _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED):
        logger.warning("cudaHostRegister of %d bytes failed with CUDA error %d; pageable copies instead", nbytes, rc)
        return None
    pointer = _device_pointer(host.data_ptr())
    if pointer is None:
        logger.warning("no device address for the pinned host tier; pageable copies instead")
        return None
    with torch.cuda.device(device):
        flat = torch.as_tensor(_CudaArrayInterface(pointer, nbytes), device=device)
    # a start phase: registering faults in every page of a sparse kv.bin (12 GiB in config.gpu.yaml)
    took = time.perf_counter() - started
    logger.log(logging.WARNING if took > SLOW_PIN_S else logging.INFO, "pinned the host tier (%.1f GiB) in %.1f s", nbytes / 2**30, took)
    return flat.view(host.dtype).view(host.shape)
