"""Which lines of the code each kernel of an optimized XLA module comes from.

A profiler trace names a step's kernels by their HLO instruction (``loop_add_fusion_63``);
the optimized HLO text (``compiled.as_text()``, or ``step_breakdown.py --hlo-dir``)
records, for every op inside a fusion, the stack frame it was traced at. This
module joins the two: :func:`kernel_sources` maps each fusion (and each
non-fused op) to the source lines of the ops it contains, innermost frame
first, so a profile's "other" kernels can be read as lines of our code.
"""

from __future__ import annotations

import collections
import re

_FILE = re.compile(r"^(\d+) \"(.*)\"$")
_LOC = re.compile(r"^(\d+) \{file_name_id=(\d+) function_name_id=\d+ line=(\d+)")
_FRAME = re.compile(r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)\}")
_COMP = re.compile(r"^%?([\w.\-]+) \(.*\) -> .* \{$|^ENTRY %?([\w.\-]+) ")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_CALLS = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")


def _tables(text: str):
    files, locs, frames = {}, {}, {}
    section = None
    for line in text.split("\n"):
        head = line.strip()
        if head in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = head
            continue
        if not head:
            section = None if section == "StackFrames" else section
            continue
        if section == "FileNames" and (m := _FILE.match(head)):
            files[int(m.group(1))] = m.group(2)
        elif section == "FileLocations" and (m := _LOC.match(head)):
            locs[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
        elif section == "StackFrames" and (m := _FRAME.match(head)):
            frames[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
    return files, locs, frames


def _stack(frame: int, files, locs, frames) -> list[str]:
    """``file:line`` of a frame and its callers, innermost first."""
    out, seen = [], set()
    while frame in frames and frame not in seen:
        seen.add(frame)
        loc, parent = frames[frame]
        if loc in locs:
            fid, line = locs[loc]
            out.append(f"{files.get(fid, '?')}:{line}")
        if parent == frame:
            break
        frame = parent
    return out


def trace_name(hlo_name: str) -> str:
    """The name a profiler trace gives the kernel of HLO instruction ``hlo_name``
    (``loop_add_fusion.63`` runs as ``loop_add_fusion_63``)."""
    return hlo_name.replace(".", "_")


def kernel_sources(text: str, keep=lambda path: True, top: int = 3) -> dict[str, list[str]]:
    """For every instruction of the entry computation (the kernels a trace names),
    keyed by its :func:`trace_name`: the ``top`` most frequent source lines among
    the ops it contains (for a fusion, the ops of its fused computation), each the
    innermost frame whose file passes ``keep``."""
    files, locs, frames = _tables(text)
    body = collections.defaultdict(list)  # computation -> [(calls, frame)]
    entry, comp = None, None
    for line in text.split("\n"):
        if m := _COMP.match(line):
            comp = m.group(1) or m.group(2)
            if line.startswith("ENTRY"):
                entry = comp
            continue
        if comp and (m := _INSTR.match(line)):
            calls, frame = _CALLS.search(line), _FRAME_ID.search(line)
            body[comp].append((m.group(1), calls.group(1) if calls else None,
                               int(frame.group(1)) if frame else None))

    def lines_of(comp_name, depth=0):
        got = []
        for _, calls, frame in body.get(comp_name, []):
            if frame is not None:
                where = [s for s in _stack(frame, files, locs, frames) if keep(s)]
                if where:
                    got.append(where[0])
            if calls and depth < 4:
                got += lines_of(calls, depth + 1)
        return got

    out = {}
    for hlo_name, calls, frame in body.get(entry, []):
        name = trace_name(hlo_name)
        found = lines_of(calls) if calls else []
        if not found and frame is not None:
            found = [s for s in _stack(frame, files, locs, frames) if keep(s)][:1]
        if found:
            out[name] = [f"{src} (x{n})" for src, n in collections.Counter(found).most_common(top)]
    return out
