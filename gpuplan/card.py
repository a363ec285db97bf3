"""Reading a card's memory through NVML (nvidia-ml-py, which vLLM depends on): no CUDA context.

The replica reads its card before its engine starts; initialising CUDA there (torch.cuda) would
put a context of its own on the card that nobody planned for, so NVML it is. NVML numbers cards
its own way (PCI bus order) and ignores CUDA_VISIBLE_DEVICES, which Ray sets to the physical
indices (or UUIDs) of the GPUs it gave the process: the first of them is the replica's card.

Without nvidia-ml-py, without a driver, or with CUDA_VISIBLE_DEVICES empty there is no card
(None), as on a CPU machine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from gpuplan.plan import Card, GiB

logger = logging.getLogger(__name__)


def _nvml():  # noqa: ANN202 - pynvml's module, or None
    try:
        import pynvml  # nvidia-ml-py: a dependency of vLLM's GPU builds
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...: no card here
        logger.debug("NVML unavailable: %s", exc)
        return None
    return pynvml


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _card(nvml, handle, source: str) -> Card:  # noqa: ANN001 - pynvml's types
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return Card(total_bytes=int(memory.total), free_bytes=int(memory.free), name=_text(nvml.nvmlDeviceGetName(handle)), source=source)


def visible_card(environ: Mapping[str, str] | None = None) -> Card | None:
    """The memory of this process's card (the first of CUDA_VISIBLE_DEVICES, else card 0), or None."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return None  # Ray gave this process no GPU
    nvml = _nvml()
    if nvml is None:
        return None
    first = (visible or "0").split(",")[0].strip()
    try:
        if first.isdigit():
            handle = nvml.nvmlDeviceGetHandleByIndex(int(first))
        else:  # GPU-<uuid> or MIG-<uuid>
            handle = nvml.nvmlDeviceGetHandleByUUID(first)
        return _card(nvml, handle, f"nvml: CUDA_VISIBLE_DEVICES {visible}" if visible else "nvml: card 0")
    except Exception as exc:  # noqa: BLE001 - an index NVML does not know: treated as no card, logged
        logger.warning("NVML could not read card %r: %s", first, exc)
        return None
    finally:
        nvml.nvmlShutdown()


def smallest_card() -> Card | None:
    """The smallest card NVML sees on this machine, or None (the builder's check before deploying:
    a replica may land on any of them)."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        cards = [_card(nvml, nvml.nvmlDeviceGetHandleByIndex(i), f"nvml: card {i}") for i in range(nvml.nvmlDeviceGetCount())]
    except Exception as exc:  # noqa: BLE001 - reported, and the replica checks its own card at start
        logger.warning("NVML could not list the cards: %s", exc)
        return None
    finally:
        nvml.nvmlShutdown()
    return min(cards, key=lambda c: c.total_bytes, default=None)


def stated_card(card_gib: float, free_gib: float | None = None) -> Card:
    """The card settings state (gpu.card_gib), for dry runs and tests."""
    total = int(card_gib * GiB)
    free = int((free_gib if free_gib is not None else card_gib) * GiB)
    return Card(total_bytes=total, free_bytes=min(free, total), name="stated card", source="settings: gpu.card_gib")
