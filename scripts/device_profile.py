"""Per-kernel device time of a jitted call, read from a JAX profiler trace.

    rows, busy_ms, wall_ms = kernel_times(lambda: step(...), calls=5)

``rows`` lists ``(kernel name, ms per call, launches per call)`` sorted by
time; ``busy_ms`` is the summed kernel time per call and ``wall_ms`` the host
wall time per call, so ``wall - busy`` bounds what the device spent waiting.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time
from collections import defaultdict


def kernel_times(run, calls: int = 5):
    """Trace ``calls`` invocations of ``run()`` (which must block until done)."""
    import jax

    run()  # compiled and warm before tracing
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        wall = (time.perf_counter() - t0) / calls
        jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(paths[0])
    total, count = defaultdict(float), defaultdict(int)
    gpu_lines = [line for plane in data.planes if plane.name.startswith("/device:GPU")
                 for line in plane.lines]
    # Kernel launches live on the stream lines; other lines repeat them (per-op
    # summaries) or hold annotations.
    streams = [ln for ln in gpu_lines if "stream" in ln.name.lower()] or gpu_lines
    for line in streams:
        for ev in line.events:
            total[ev.name] += ev.duration_ns
            count[ev.name] += 1
    rows = sorted(((n, t / calls / 1e6, count[n] / calls) for n, t in total.items()),
                  key=lambda r: -r[1])
    kernel_times.last_lines = sorted({ln.name for ln in gpu_lines})
    return rows, sum(r[1] for r in rows), wall * 1e3


def print_kernel_times(title: str, rows, busy_ms: float, wall_ms: float, top: int = 15):
    print(f"{title}: wall {wall_ms:.2f} ms per call, kernels {busy_ms:.2f} ms "
          f"({len(rows)} distinct)")
    for name, ms, n in rows[:top]:
        print(f"  {ms:8.3f} ms  x{n:<5.0f} {name[:90]}")
