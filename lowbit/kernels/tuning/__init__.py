"""Tuning constants (tiles, thresholds, split targets) per GPU architecture, selected by the device capability.

Kernels and routes read `current()` at call time; benchmarks change values with `with override(name=value):`.
"""
import contextlib
import dataclasses
import functools

from lowbit.kernels.tuning.fields import DecodeVariant, PrefillTiles, Tuning, frozen

__all__ = ["DecodeVariant", "PrefillTiles", "Tuning", "current", "for_capability", "frozen", "override"]

_OVERRIDE: list[Tuning] = []  # innermost override last


def for_capability(capability: tuple[int, int] | None) -> Tuning:
    """The table for a CUDA compute capability (None: no GPU): Hopper's for sm_90, else the generic default."""
    if capability is not None and capability[0] == 9:
        from lowbit.kernels.tuning.sm90 import SM90
        return SM90
    from lowbit.kernels.tuning.default import DEFAULT
    return DEFAULT


@functools.cache
def _device_table() -> Tuning:
    import torch
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return for_capability(capability)


def current() -> Tuning:
    """The Tuning in force: the innermost override's, else the current CUDA device's (cached; default without GPU)."""
    return _OVERRIDE[-1] if _OVERRIDE else _device_table()


@contextlib.contextmanager
def override(**changes):
    """Within this block current() is dataclasses.replace(current(), **changes) (benchmarks, tests)."""
    _OVERRIDE.append(dataclasses.replace(current(), **changes))
    try:
        yield _OVERRIDE[-1]
    finally:
        _OVERRIDE.pop()
