"""Device kinds: ``cpu``, or ``cuda:`` and the device's name as torch reports it (``cuda:NVIDIA H200``). A job
carries its kind in ``params.device_kind``; with workers, each kind has its own procrastinate queue."""

from __future__ import annotations

import re
from collections.abc import Iterable

DEFAULT_KIND = "cpu"
QUEUE_PREFIX = "device-"
# What a device kind may be: cpu, or cuda: and the device's name as torch reports it ("cuda:NVIDIA H200").
KIND_PATTERN = re.compile(r"^(cpu|cuda:[A-Za-z0-9 ._()+\-]{1,100})$")


def detect_device_kinds() -> tuple[str, ...]:
    """``cpu``, and ``cuda:<name>`` for each CUDA device present (one kind per distinct name)."""
    import torch

    kinds = [DEFAULT_KIND]
    if torch.cuda.is_available():
        kinds.extend(f"cuda:{torch.cuda.get_device_name(index)}" for index in range(torch.cuda.device_count()))
    return tuple(dict.fromkeys(kinds))


def check_kind(kind: str) -> str:
    """``kind`` if well formed (cpu, or cuda:NAME), else ValueError saying what a kind looks like."""
    if not KIND_PATTERN.match(kind):
        shown = kind if len(kind) <= 40 else kind[:37] + "..."
        raise ValueError(f"device kind {shown!r} is not cpu or cuda:NAME (NAME as torch.cuda.get_device_name "
                         "reports it, e.g. cuda:NVIDIA H200)")
    return kind


def queue_for(kind: str) -> str:
    """The procrastinate queue of a device kind: ``device-cpu``, ``device-cuda-nvidia-h200`` (a name that is safe as
    a LISTEN channel)."""
    return QUEUE_PREFIX + re.sub(r"[^a-z0-9]+", "-", check_kind(kind).lower()).strip("-")


def kind_device_type(kind: str) -> str:
    """``cpu`` or ``cuda``: the torch device type a kind runs on."""
    return kind.partition(":")[0]


def resolve_kind(requested: str | None, device: str, available: Iterable[str]) -> str:
    """The device kind a job runs on: ``requested`` if available and of ``device``'s type; without it, cpu for a cpu
    job, and the one kind of ``device``'s type if there is exactly one. ValueError says what to send otherwise."""
    available = tuple(available)
    if requested is None:
        matching = [kind for kind in available if kind_device_type(kind) == device]
        if len(matching) == 1:
            return matching[0]
        if not matching:
            raise ValueError(f"no device kind of type {device!r} is available; device kinds: {', '.join(available)}")
        raise ValueError(f"several device kinds are of type {device!r} ({', '.join(matching)}); name one in "
                         "device_kind")
    check_kind(requested)
    if requested not in available:
        raise ValueError(f"device kind {requested!r} is not available; device kinds: {', '.join(available)}")
    if kind_device_type(requested) != device:
        raise ValueError(f"device kind {requested!r} does not run device {device!r}; send device "
                         f"{kind_device_type(requested)!r} with it")
    return requested
