"""Where one call's time goes, for the benchmarks: ``torch.profiler`` around a callable, the device's busy time
against the wall time and the top ops by self device time. Used by ``train_throughput.py --profile`` (one
optimizer step) and ``titans.py --profile`` (one forward and backward of the memory layer)."""

from __future__ import annotations

import time
from typing import Callable

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_call(fn: Callable[[], object], device: torch.device, top: int) -> dict:
    """Run ``fn()`` once under ``torch.profiler``. ``step_s`` is its wall time (the device synchronised before and
    after), ``device_busy_s`` the summed self time of the device's kernels and copies (on CPU: every op's self
    time), so ``busy_fraction`` near 1 means device-bound and well below 1 host-bound (launch overhead, Python);
    ``launches`` the device's events (None on CPU); ``top`` the ``top`` ops by self device time with their launch
    counts. The profiler adds host overhead to the call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        step_s = time.perf_counter() - t0
    # On a GPU the device's own events (kernels, copies): an ATen op's row repeats its kernels' time.
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0
              and (not cuda or e.device_type == DeviceType.CUDA)]
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    busy = sum(getattr(e, key) for e in events) / 1e6
    return {"step_s": step_s, "device_busy_s": busy, "busy_fraction": busy / step_s if step_s else None,
            "launches": sum(e.count for e in events) if cuda else None,
            "top": [{"name": e.key[:120], "self_s": round(getattr(e, key) / 1e6, 6), "count": e.count}
                    for e in events[:top]]}
