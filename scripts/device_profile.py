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
    gaps = defaultdict(float)  # idle ns on a stream before a kernel, by that kernel
    details = {}
    for line in streams:
        events = sorted(line.events, key=lambda ev: ev.start_ns)
        for prev, ev in zip([None] + events[:-1], events):
            if ev.name not in details:
                details[ev.name] = launch_details(ev)
            total[ev.name] += ev.duration_ns
            count[ev.name] += 1
            if prev is not None:
                idle = ev.start_ns - (prev.start_ns + prev.duration_ns)
                if 0 < idle < 1e6:  # a gap between calls is not a launch gap
                    gaps[ev.name] += idle
    rows = sorted(((n, t / calls / 1e6, count[n] / calls) for n, t in total.items()),
                  key=lambda r: -r[1])
    kernel_times.last_lines = sorted({ln.name for ln in gpu_lines})
    kernel_times.launches = sum(count.values()) / calls
    kernel_times.details = {n: d for n, d in details.items() if d}
    kernel_times.gaps = sorted(((n, g / calls / 1e6) for n, g in gaps.items()),
                               key=lambda r: -r[1])
    return rows, sum(r[1] for r in rows), wall * 1e3


def launch_details(event) -> str:
    """The profiler's launch record of a kernel event (registers per thread, static
    and dynamic shared memory, grid, block, theoretical occupancy: the compile XLA
    ran, which the ``triton`` package's compile in kernel_resources.py only
    approximates), or "" where the trace holds none."""
    try:
        stats = dict(event.stats)
    except (TypeError, ValueError):
        return ""
    return str(stats.get("kernel_details", "")).strip()


def print_kernel_times(title: str, rows, busy_ms: float, wall_ms: float, top: int = 15):
    print(f"{title}: wall {wall_ms:.2f} ms per call, kernels {busy_ms:.2f} ms "
          f"({len(rows)} distinct)")
    for name, ms, n in rows[:top]:
        print(f"  {ms:8.3f} ms  x{n:<5.0f} {name[:90]}")
    gaps = getattr(kernel_times, "gaps", [])
    if gaps:
        print(f"  {getattr(kernel_times, 'launches', 0):.0f} launches per call; idle "
              f"{sum(g for _, g in gaps):.2f} ms per call inside calls, most before:")
        for name, ms in gaps[:top]:
            print(f"  {ms:8.3f} ms idle before {name[:80]}")


#: Kernel-name fragments -> step part, first match wins. XLA names its fusions by
#: their root operation, so the split is by kind of work, not by source line:
#: "matmuls" are the projections, MLP and logits; "cache writes" the scatters
#: (page writes, and DiffKV's demotions and side-array updates) and the Pallas
#: token-writes launches; "other" holds norms, RoPE, sampling and the page
#: allocation (compaction).
PARTS = (("paged_decode", "attention kernel"), ("policy_scores", "policy kernel"),
         ("token_writes", "cache writes"), ("decide_and_write", "cache writes"),
         ("gemm", "matmuls"), ("cublas", "matmuls"), ("dot", "matmuls"),
         ("scatter", "cache writes"), ("memcpy", "copies"))


def step_parts(rows) -> dict[str, float]:
    """``kernel_times`` rows summed into :data:`PARTS` (ms per call)."""
    out: dict[str, float] = defaultdict(float)
    for name, ms, _ in rows:
        low = name.lower()
        part = next((p for frag, p in PARTS if frag in low), "other")
        out[part] += ms
    return dict(out)
