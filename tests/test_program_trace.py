"""Program traces of the decode launch (``LaunchConfig.trace_programs``,
:func:`pallas_kernels.paged_decode.program_trace`) and their summary
(``scripts/program_timeline.py``).

The clocks are the GPU's special registers, so a trace needs a compiled launch:
on the CPU the launch is lowered for CUDA and the clock reads are checked to
mark the program's start (before its first load), its loops' start and end, and
its end (after its stores and its row's merge); where the ``triton`` package is
installed, in the PTX it compiles to as well. Marked ``gpu``: a real trace, and
the traced launch's outputs equal to the untraced.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_decode as pdk
from pallas_kernels.paged_decode import TRACE_COLUMNS
from scripts.program_timeline import (grade_items, item_kinds, kind_times, label,
                                      merge_excess, parse_settings, reorder_items, summarize,
                                      tail_split)

from tests.test_early_row_loads import assert_equal_where_written, launch_case
from tests.test_paged_decode_kernel import lowering_tiers

D, G = 128, 4
CFG = pdk.LaunchConfig(transposed=True, page_lanes=2, tier_weights=(1, 2))


def traced_fn(merged: bool):
    tiers = lowering_tiers(D)
    work = pdk.plan_work(jnp.ones((1, 1), jnp.int32), 4)
    return jax.jit(lambda q: pdk.program_trace(q, tiers, work=work, group=G, cfg=CFG,
                                               padded_rows=8, merged=merged))


def lowered(merged: bool) -> str:
    from scripts.kernel_resources import strip_locations, triton_ir

    return strip_locations(triton_ir(traced_fn(merged), jnp.zeros((1, 1, G, D), jnp.bfloat16)))


def positions(text: str, pattern: str) -> list[int]:
    return [m.start() for m in re.finditer(pattern, text)]


@pytest.mark.parametrize("merged", [False, True])
def test_clock_reads_mark_the_program_in_the_lowering(merged):
    ir = lowered(merged)
    timer, cycles = positions(ir, r"%globaltimer_lo"), positions(ir, r"%clock;")
    assert len(timer) == len(cycles) == len(pdk.TRACE_POINTS) == 4
    assert len(positions(ir, r"%smid")) == 1
    start, loop, loop_end, end = timer
    loads, loops = positions(ir, r"= tt\.load "), positions(ir, r"scf\.for")
    stores = positions(ir, r"tt\.store ")
    if merged:  # the row's merge (its atomic, its folding loop) between the last two
        atomic = positions(ir, r"tt\.atomic_rmw")
        assert loop_end < min(atomic) and max(loops) < end
        loops = [at for at in loops if at < min(atomic)]  # the tiers' loops
    assert start < min(loads) and loop < min(loops) < max(loops) < loop_end < end
    # The end: after every store but the two of its own clocks.
    assert sum(at > end for at in stores) == 2


@pytest.mark.parametrize("merged", [False, True])
def test_clock_reads_mark_the_program_in_the_ptx(merged, tmp_path):
    triton = pytest.importorskip("triton", reason="the PTX check compiles with the triton "
                                 "package (not a test dependency); the lowering test runs")
    from scripts.kernel_resources import compile_sass

    path = tmp_path / "k.ttir"
    path.write_text(lowered(merged))
    compile_sass(triton, str(path), str(tmp_path), "k", 1, 3)
    ptx = (tmp_path / "k.ptx").read_text()
    start, loop, loop_end, end = positions(ptx, r"%globaltimer_lo")
    # Loop headers (the compiler's marks) fall between the loop marks.
    headers = positions(ptx, r"Loop Header")
    if merged:  # the row's merge (its atomic, its folding loop) between the last two
        atomic = positions(ptx, r"atom\.global")
        assert loop_end < min(atomic) and max(headers) < end
        headers = [at for at in headers if at < min(atomic)]  # the tiers' loops
    assert headers and start < loop < min(headers) and max(headers) < loop_end < end
    assert positions(ptx, r"%smid")[0] < loop


def test_a_trace_needs_a_compiled_launch():
    q, tiers = launch_case("k8v4+k4v2", 64, 3, seed=1)
    work = pdk.plan_work(pdk.row_pages(tiers), 16)
    traced = pdk.LaunchConfig(trace_programs=True, dot_dtype="float32")
    with pytest.raises(ValueError, match="compiled launch"):
        pdk._decode_call(q, tiers, 3, 3, traced, work, True)
    # The launches that return attention, not a trace, refuse the setting.
    with pytest.raises(ValueError, match="program_trace"):
        pdk.paged_decode_partials(q, tiers, cfg=traced, work=work, interpret=True)
    with pytest.raises(ValueError, match="program_trace"):
        pdk.paged_decode_merged(q, tiers, cfg=traced, work=work, interpret=True)


PROLOGUE_NS, LOOP_FIXED_NS, PER_UNIT_NS, EPILOGUE_NS = 300, 1000, 250, 500


def synthetic_trace(sms=4, wrap_at=2**32 - 5000, merge_ns=None):
    """A launch of 4 programs per multiprocessor run back to back, items of 3 - 12
    units in four rows (``seg``), each row's last item to end merging for
    ``merge_ns`` more; the timer starts just below its 32-bit wrap and the cycle
    counters run at 2 GHz from a different origin per multiprocessor."""
    rng = np.random.default_rng(0)
    n = sms * 4
    units = rng.integers(3, 13, n)
    seg = np.repeat(np.arange(4), n // 4)
    points = np.zeros((n, 4), np.int64)
    free = np.zeros(sms, np.int64)
    for i in range(n):
        sm = i % sms
        points[i, 0] = free[sm] + 40 * (i // sms)  # the last starts 120 ns late
        points[i, 1] = points[i, 0] + PROLOGUE_NS
        points[i, 2] = points[i, 1] + LOOP_FIXED_NS + PER_UNIT_NS * units[i]
        points[i, 3] = points[i, 2] + EPILOGUE_NS
        free[sm] = points[i, 3]
    merging = [np.flatnonzero(seg == r)[np.argmax(points[seg == r, 3])] for r in range(4)]
    if merge_ns:
        points[merging, 3] += merge_ns
    sm = np.arange(n) % sms
    cycles = 7919 * sm[:, None] + 2 * points
    trace = np.concatenate([points + wrap_at, cycles, sm[:, None]], axis=1)
    trace = ((trace + 2**31) % 2**32 - 2**31).astype(np.int32)  # through the wrap
    return trace, units, seg, merging


def test_summary_recovers_the_schedule_through_the_timer_wrap():
    trace, units, _, _ = synthetic_trace()
    used = np.ones(len(units), bool)
    s = summarize(trace, units, used)
    assert s["clock_ghz"] == pytest.approx(2.0)
    assert s["prologue_us"] == pytest.approx(0.3) and s["epilogue_us"] == pytest.approx(0.5)
    np.testing.assert_allclose(s["items_us"]["loops"], 1.0 + 0.25 * units)
    assert s["fixed_us"] == pytest.approx(1.8, abs=1e-6)
    assert s["per_unit_us"] == pytest.approx(0.25, abs=1e-6)
    assert s["multiprocessors"] == 4 and s["programs_per_sm"] == {"min": 4, "max": 4}
    assert s["most_at_once"] == 4
    ends = np.asarray(s["end_us"])
    assert s["span_us"] == pytest.approx(ends.max()) and min(s["start_us"]) == 0
    assert s["last_start_us"] > 0 and 0 < s["tail_us"] < s["span_us"]
    assert s["busy"] == pytest.approx(np.sum(1.8 + 0.25 * units) / (4 * ends.max()))
    assert 0 < s["busy"] < 1
    running = s["running_per_us"]
    assert len(running) == int(np.ceil(ends.max())) + 1 and running[0] == 4 and running[-1] == 0


def test_summary_leaves_out_unused_items_and_finds_the_merge():
    trace, units, seg, merging = synthetic_trace(merge_ns=3000)
    used = np.ones(len(units), bool)
    spare = min(set(range(len(units))) - set(merging))
    used[spare] = False  # an unused item: its clocks are left out
    trace[spare, :4] = [123, 124, 125, 126]
    s = summarize(trace, units, used)
    assert s["items"] == len(units) - 1 and min(s["start_us"][i] for i in np.flatnonzero(used)) == 0
    assert merge_excess(s, used, seg) == pytest.approx(3.0)
    assert np.isnan(merge_excess(s, used, np.arange(len(units))))  # rows of one item


@pytest.mark.gpu
@pytest.mark.parametrize("merged", [False, True])
def test_compiled_trace_on_gpu(merged):
    q, tiers = launch_case("k8v4+k4v2 wide", 128, 4, seed=7)
    cfg = pdk.LaunchConfig(transposed=True, page_lanes=2, tier_weights=(1, 2))
    work = pdk.plan_work(pdk.row_pages(tiers, weights=(1, 2)), 64)
    trace = np.asarray(pdk.program_trace(q, tiers, work=work, group=4, cfg=cfg,
                                         padded_rows=8, merged=merged))
    items = np.asarray(work.items)
    used = np.asarray(work.seg) < work.num_rows
    s = summarize(trace, items[:, 3] - items[:, 2], used)
    assert 0 < s["span_us"] < 1e4 and s["duration_us"]["min"] > 0
    assert 0.5 < s["clock_ghz"] < 3.0
    for phase in ("prologue", "loops", "epilogue"):  # each under the whole program's time
        times = np.asarray(s["items_us"][phase])[used]
        assert (times >= 0).all() and (times <= 1.01 * s["duration_us"]["max"] + 0.1).all()
    assert all(0 <= x < 1024 for x in s["sm"])
    # The traced launch computes what the untraced one does.
    merge = (pdk.merge_counters(*q.shape[:2]), jnp.float32, 4, True) if merged else None
    qp = pdk.pad_group(q, 8)
    plain = pdk._decode_call(qp, tiers, 4, 8, cfg, work, False, merge)
    traced = pdk._decode_call(qp, tiers, 4, 8, dataclasses.replace(cfg, trace_programs=True),
                              work, False, merge)
    # Compared where the launch writes: the used items' partials, the merged rows that
    # have items, each tier's logits below its token count (the rest is never stored).
    plain, traced = [np.asarray(x) for x in plain], [np.asarray(x) for x in traced[:-1]]
    assert len(plain) == len(traced)
    has_items = np.bincount(np.asarray(work.seg)[used], minlength=work.num_rows) > 0
    has_items = has_items.reshape(q.shape[:2])
    n_merged = 4 if merged else 0
    for x, y in zip(plain[3:3 + n_merged], traced[3:3 + n_merged]):
        np.testing.assert_array_equal(x if x.ndim == 1 else x[has_items],
                                      y if y.ndim == 1 else y[has_items])
    assert_equal_where_written(plain[:3] + plain[3 + n_merged:],
                               traced[:3] + traced[3 + n_merged:], work, tiers)


def test_settings_parse_and_refuse_unknown_ones():
    rest = {"tail": 0, "low_weight": 0, "order": "row", "snap": 0, "gap": 0, "grade": 0,
            "row_chunk": 0, "row_share": 25}
    assert parse_settings("m=last,el=1,wave=528;n=2112,st=2") == [
        {"merge": "last", "early": 1, "wave": 528, "items": 0, "stages": 0, "warps": 0, **rest},
        {"merge": "rows", "early": 0, "wave": -1, "items": 2112, "stages": 2, "warps": 0,
         **rest}]
    assert [label(x) for x in parse_settings(
        "m=rows;wave=0,el=1;nw=2;tail=25,tw=15;ord=mixed,tw=15;ord=row;m=last,tw=15,sn=10;"
        "yg=9,tw=15;m=last,tw=15,gp=12;m=last,rc=4;rc=8,rs=50")] == [
        "m=rows,el=0", "m=rows,el=1,wave=off", "m=rows,el=0,nw=2", "m=rows,el=0,tail=25,tw=15",
        "m=rows,el=0,tw=15,ord=mixed", "m=rows,el=0", "m=last,el=0,tw=15,sn=10",
        "m=rows,el=0,tw=15,yg=9", "m=last,el=0,tw=15,gp=12", "m=last,el=0,rc=4,rs=25",
        "m=rows,el=0,rc=8,rs=50"]
    for bad in ("m=first", "el=2", "lanes=2", "wave=-3", "st=two", "tw=1.5", "ord=random",
                "sn=0.1"):
        with pytest.raises(SystemExit, match="unknown setting"):
            parse_settings(bad)
    for bad in ("m=last,tail=25", "tail=100", "m=last,ord=index", "ord=index,tail=25"):
        with pytest.raises(SystemExit, match="needs m=rows"):  # a launch of partials only
            parse_settings(bad)
    with pytest.raises(SystemExit, match="under 50"):
        parse_settings("sn=50")
    with pytest.raises(SystemExit, match="cannot be combined"):
        parse_settings("tw=15,sn=10,gp=12")
    for bad in ("m=last,yg=9", "yg=9,tail=25", "yg=9,ord=index", "yg=50"):
        with pytest.raises(SystemExit, match="yg="):
            parse_settings(bad)
    for bad in ("rc=4,tail=25", "rc=4,ord=index", "rc=4,yg=9", "rc=4,el=1", "rc=4,rs=101"):
        with pytest.raises(SystemExit, match="rc=4|rs=101"):
            parse_settings(bad)


def test_reorder_items_by_index_in_row_and_by_kind():
    # two rows of 3 items: row 0 has 30 high units (items 0-26 high, 26-52 both, 52-60
    # low), row 1 has 0 (all low); an unused item last
    items = np.array([[0, 0, 0, 26], [0, 0, 26, 52], [0, 0, 52, 60],
                      [0, 1, 0, 20], [0, 1, 20, 40], [0, 1, 40, 45], [0, 0, 0, 0]])
    seg = np.array([0, 0, 0, 1, 1, 1, 2])
    high = np.array([30, 0])
    same = reorder_items(items, seg, 2, "row", high)
    assert same[0].tolist() == items.tolist() and same[1].tolist() == seg.tolist()
    by_index, s_index = reorder_items(items, seg, 2, "index", high)
    assert by_index[:, 2].tolist() == [0, 0, 26, 20, 52, 40, 0]
    assert s_index.tolist() == [0, 1, 0, 1, 0, 1, 2]
    by_kind, s_kind = reorder_items(items, seg, 2, "mixed", high)
    # both tiers (row 0's second), high only (row 0's first), then low only in row order
    assert by_kind[:, 2].tolist() == [26, 0, 52, 0, 20, 40, 0]
    assert s_kind.tolist() == [0, 0, 0, 1, 1, 1, 2]
    for new, new_seg in (same, (by_index, s_index), (by_kind, s_kind)):  # the same items
        assert sorted(map(tuple, new.tolist())) == sorted(map(tuple, items.tolist()))
        assert new_seg[-1] == 2


def test_tail_split_runs_every_items_last_part_after_all_first_parts():
    items = np.array([[0, 0, 0, 26], [0, 0, 26, 52], [0, 1, 0, 3], [0, 1, 3, 4], [0, 0, 0, 0]])
    seg = np.array([0, 0, 1, 1, 2])
    new, new_seg = tail_split(items, seg, 2, 25)
    # 26 units: the last 6 apart; 3 units: none (a part of no units is left out)
    assert new.tolist() == [[0, 0, 0, 20], [0, 0, 26, 46], [0, 1, 0, 3], [0, 1, 3, 4],
                            [0, 0, 20, 26], [0, 0, 46, 52], [0, 0, 0, 0]]
    assert new_seg.tolist() == [0, 0, 1, 1, 0, 0, 2]
    # every row's units are covered once
    for row in (0, 1):
        spans = sorted(map(tuple, new[new_seg == row][:, 2:]))
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def _run_timeline_script(*args: str):
    """``scripts/program_timeline.py`` with ``args`` in a process of its own."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, os.path.join(root, "scripts", "program_timeline.py"),
                           *args], capture_output=True, text=True, timeout=600, cwd=root)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusal off the GPU")
def test_timeline_script_says_it_needs_a_gpu():
    proc = _run_timeline_script()
    assert proc.returncode == 2 and "needs a GPU" in proc.stderr


def test_timeline_script_refuses_a_setting_the_planner_refuses_before_any_launch():
    # a gap of 12 units needs items of more than 12 units: the 1 : 2 weights' are 2
    proc = _run_timeline_script("--batch", "2", "--context", "1024",
                                "--settings", "m=last;m=last,gp=12")
    assert proc.returncode == 1
    assert "--settings m=last,el=0,gp=12: gap must be in [0, min_pages = 2)" in proc.stderr
    assert "needs a GPU" not in proc.stderr


def test_grade_items_lightens_the_odd_items_and_runs_them_last():
    # two rows of 100 and 50 units in 3 / 2 items; an unused item last
    items = np.array([[0, 0, 0, 34], [0, 0, 34, 68], [0, 0, 68, 100],
                      [0, 1, 0, 25], [0, 1, 25, 50], [0, 0, 0, 0]])
    seg = np.array([0, 0, 0, 1, 1, 2])
    new, s = grade_items(items, seg, 2, 10)
    # row 0: shares 100 / 90 / 100 of 290; row 1: 100 / 90 of 190; even items first
    assert new.tolist() == [[0, 0, 0, 34], [0, 0, 65, 100], [0, 1, 0, 26],
                            [0, 0, 34, 65], [0, 1, 26, 50], [0, 0, 0, 0]]
    assert s.tolist() == [0, 0, 1, 0, 1, 2]
    for row, units in ((0, 100), (1, 50)):  # every unit of a row in one item
        covered = np.zeros(units, int)
        for _, _, b, e in new[s == row]:
            covered[b:e] += 1
        assert np.all(covered == 1)
    with pytest.raises(ValueError, match="planned order"):
        grade_items(items[[3, 0, 1, 2, 4, 5]], seg[[3, 0, 1, 2, 4, 5]], 2, 10)


def _trace(sm, end_ns):
    """A trace of programs on multiprocessors ``sm`` ending at ``end_ns``, their loop
    and epilogue ending with them."""
    trace = np.zeros((len(sm), len(TRACE_COLUMNS)), np.int64)
    col = {n: i for i, n in enumerate(TRACE_COLUMNS)}
    trace[:, col["sm"]] = sm
    for c in ("end_ns", "loop_cycles", "loop_end_cycles", "end_cycles"):
        trace[:, col[c]] = end_ns
    return trace.astype(np.int32)


def test_summary_splits_the_programs_by_their_place_on_the_multiprocessor():
    # 4 programs on 2 multiprocessors (0, 1, 0, 1): the second on each took longer
    trace = _trace([0, 1, 0, 1], [10_000, 12_000, 20_000, 22_000])
    out = summarize(trace, np.array([1, 1, 2, 2]), np.ones(4, bool))
    assert out["early_us"] == pytest.approx(11.0) and out["late_us"] == pytest.approx(21.0)


def _two_sm_trace():
    """Programs 0, 2 on multiprocessor 0 (10 units, ending at 5 and 10 us), 1, 3 on
    multiprocessor 1 (10 units, ending at 12 and 20 us), and an unused item 4 on
    multiprocessor 1 that ends last."""
    trace = _trace([0, 1, 0, 1, 1], [5_000, 12_000, 10_000, 20_000, 30_000])
    return trace, np.array([5, 5, 5, 5, 0]), np.array([1, 1, 1, 1, 0], bool)


def test_summary_bounds_what_sharing_the_work_out_could_win():
    out = summarize(*_two_sm_trace())
    # the unused item's end is no multiprocessor's end; the span is the used items'
    assert out["sm_end_us"] == {"min": 10.0, "mean": 15.0, "max": 20.0}
    assert out["span_us"] == pytest.approx(20.0)
    # rates 10 / 10 and 10 / 20 units per us: 20 units end together at 20 / 1.5 us
    assert out["balanced_us"] == pytest.approx(20 / 1.5)


def test_sm_end_agreement_compares_the_multiprocessors_between_launches():
    from scripts.program_timeline import sm_end_agreement

    used = np.ones(4, bool)

    def run(ends, sm=(0, 1, 2, 3)):
        return {"end_us": list(ends), "sm": list(sm), "start_us": [0.0] * 4}

    same = [run([10, 20, 30, 40]), run([11, 21, 29, 41], sm=(0, 1, 2, 3))]
    assert sm_end_agreement(same, used) == pytest.approx(
        np.corrcoef([10, 20, 30, 40], [11, 21, 29, 41])[0, 1])
    # the GPU gave the programs other multiprocessors: the ends are compared by
    # multiprocessor, not by program
    moved = [run([10, 20, 30, 40]), run([40, 30, 20, 10], sm=(3, 2, 1, 0))]
    assert sm_end_agreement(moved, used) == pytest.approx(1.0)
    assert sm_end_agreement(moved[:1], used) != sm_end_agreement(moved[:1], used)  # NaN


@pytest.mark.parametrize("gz,with_items", [(True, True), (False, False)])
def test_stored_results_print_again_without_a_gpu(tmp_path, gz, with_items):
    import gzip
    import json
    import os
    import subprocess
    import sys

    runs = []
    for _ in range(2):
        r = summarize(*_two_sm_trace())
        del r["balanced_us"], r["sm_end_us"]  # as a file written before these figures
        runs.append(r)
    res = {"setting": "m=last,el=0", "wave": 4, "work_items": 5, "runs": runs}
    if with_items:
        res["items"] = [[0, 0, 0, 5], [0, 1, 0, 5], [0, 0, 5, 10], [0, 1, 5, 10], [0, 0, 0, 0]]
    data = {"device": "NVIDIA H200", "bytes": 123_000_000, "results": [res],
            "args": {"model": "llama3-8b", "batch": 32, "context": 4096,
                     "variant": "diffkv-mix", "tiles": "tokens"}}
    path = str(tmp_path / ("t.json.gz" if gz else "t.json"))
    with (gzip.open if gz else open)(path, "wt") as fh:
        json.dump(data, fh)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "program_timeline.py"),
                           "--stored", path], capture_output=True, text=True, timeout=600,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("m=last,el=0 ")]
    # two launches, then the agreement line, then the running counts
    assert len(rows) == 4
    # 4 used items either way: without the work items, the first 4 count, a unit each
    assert " 4 " in rows[0] and "15.0/ 20.0" in rows[0] and "13.33" in rows[0]
    assert rows[2].split()[1] == "nan"  # two multiprocessors: too few to correlate


def test_items_by_what_they_hold_of_their_rows_tiers():
    # Row (0, 0) has 45 high units, row (0, 1) 10: an item ending at the boundary holds
    # high pages only, one starting there low pages only; an unused item is -1.
    items = [[0, 0, 0, 26], [0, 0, 26, 52], [0, 0, 45, 78], [0, 1, 0, 10], [0, 1, 10, 30],
             [0, 0, 0, 0]]
    kinds = item_kinds(items, np.array([[45, 10]]), 2)
    assert kinds == [0, 1, 2, 0, 2, -1]
    runs = [{"start_us": [0, 0, 1, 0, 0, 0], "end_us": [40, 42, 37, 20, 35, 0]}]
    times = kind_times({"kinds": kinds, "runs": runs})
    assert times == [[(2, 30.0), (1, 42.0), (2, 35.5)]]


def test_stored_files_get_their_items_kinds_from_the_rebuilt_case(tmp_path):
    # A file from before kinds were recorded: the case is rebuilt from its arguments.
    # Llama3-8B heads at 512 tokens of the realistic mix: 179 high tokens (6 pages of
    # 32, 6 units) and 230 low (4 pages of 64, 8 units under 1 : 2) in every row.
    import json

    from scripts.program_timeline import load_stored

    items = [[0, 0, 0, 6], [0, 0, 6, 14], [0, 1, 0, 10], [0, 1, 10, 14], [0, 0, 0, 0]]
    runs = [{"start_us": [0.0] * 5, "end_us": [10.0, 12.0, 16.0, 6.0, 0.0],
             "sm": [0, 1, 0, 1, 0], "balanced_us": 1.0, "sm_end_us": {}}]
    data = {"device": "NVIDIA H200", "bytes": 1, "args": {
        "model": "llama3-8b", "batch": 2, "context": 512, "variant": "diffkv-mix",
        "tiles": "tokens"}, "results": [
        {"setting": "m=last,el=0", "items": items, "runs": runs,
         "launch": {"tier_weights": [1, 2]}}]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    res = load_stored(str(path))["results"][0]
    assert res["kinds"] == [0, 2, 1, 2, -1]
    assert kind_times(res) == [[(1, 10.0), (1, 16.0), (2, 9.0)]]
