"""``scripts/sm_speeds.py``: multiprocessors slow by themselves, read from stored traces."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from scripts.sm_speeds import (agreement, collect, file_figures, launch_figures,
                               span_without_usual_ends)

SMS = 8


def _launch(rng, slow, per_sm=3, jitter=0.5, start_late=False):
    """One launch of ``SMS * per_sm`` programs of 10 us placed at random (a new
    placement every launch), those on the multiprocessors in ``slow`` 20% longer,
    plus noise; one unused item at the end."""
    n = SMS * per_sm
    sm = rng.permutation(np.repeat(np.arange(SMS), per_sm))
    start = rng.uniform(0, 0.2, n)
    dur = 10 * np.where(np.isin(sm, slow), 1.2, 1.0) + rng.normal(0, jitter, n)
    if start_late:
        start[0] = 100.0  # a second wave: this program began after the others ended
    end = start + dur
    return {"sm": sm.tolist() + [0], "start_us": start.tolist() + [0.0],
            "end_us": end.tolist() + [0.0]}


def _write(path, runs, device="NVIDIA H200"):
    n = len(runs[0]["sm"])
    items = [[0, 0, i, i + 1] for i in range(n - 1)] + [[0, 0, 0, 0]]
    data = {"device": device, "results": [{"setting": "m=last", "items": items, "runs": runs}]}
    with gzip.open(path, "wt") as fh:
        json.dump(data, fh)
    return str(path)


def test_launch_figures_normalize_and_skip_second_waves():
    rng = np.random.default_rng(0)
    run = _launch(rng, slow=[2], jitter=0.0)
    used = np.array([True] * (len(run["sm"]) - 1) + [False])
    speed, end, last = launch_figures(run, used, SMS)
    assert np.nanmean(speed) == pytest.approx(1.0)
    # multiprocessor 2's programs take 1.2x the others': 1.2 / mean(1.2, 1 x 7)
    assert speed[2] == pytest.approx(1.2 / (1.2 / SMS + (SMS - 1) / SMS), rel=1e-6)
    assert np.nanmean(end) == pytest.approx(0.0, abs=1e-9)
    assert end[2] == pytest.approx(np.nanmax(end))
    assert np.nanmax(last) == pytest.approx(max(run["end_us"]))
    assert launch_figures(_launch(rng, slow=[2], start_late=True), used, SMS) is None


def test_persistent_slow_multiprocessors_are_found_and_taken_off(tmp_path):
    rng = np.random.default_rng(1)
    paths = [_write(tmp_path / f"t{k}.json.gz",
                    [_launch(rng, slow=[1, 5], jitter=0.2) for _ in range(3)]) for k in range(2)]
    launches = collect(paths, "H200", SMS)
    assert len(launches) == 6
    speeds = np.array([x["speed"] for x in launches])
    assert agreement(speeds) > 0.9
    assert set(np.argsort(np.nanmean(speeds, 0))[-2:]) == {1, 5}
    # placed anew every launch (3 of 24 programs on one multiprocessor: 1 in 8 stay
    # by chance), and each file's slow multiprocessors are the other file's
    for n, same, corr, spread in file_figures(launches).values():
        assert n == 3 and same < 0.4 and corr > 0.9 and spread > 0.05
    # the slow multiprocessors end 2 us after the others, about 1.5 us after the mean of the
    # eight ends: that offset, known from the other file, off each one's end
    for span, less in span_without_usual_ends(launches):
        assert 0.8 < span - less < 2.0
    # a device the files do not name: nothing
    assert collect(paths, "H100", SMS) == []


def test_without_persistent_slowness_the_halves_do_not_agree(tmp_path):
    rng = np.random.default_rng(2)
    path = _write(tmp_path / "t.json.gz", [_launch(rng, slow=[], jitter=1.0) for _ in range(40)])
    launches = collect([path], "H200", SMS)
    speeds = np.array([x["speed"] for x in launches])
    assert abs(agreement(speeds)) < 0.8
    # one file: no other to compare its speeds with
    (n, same, corr, _), = file_figures(launches).values()
    assert n == 40 and same < 0.4 and np.isnan(corr)
    # one file alone: no other file to take the usual ends from
    assert all(less is None for _, less in span_without_usual_ends(
        collect([path], "H200", SMS)))


def test_the_script_prints_its_table(tmp_path):
    rng = np.random.default_rng(3)
    paths = [_write(tmp_path / f"t{k}.json.gz", [_launch(rng, slow=[4]) for _ in range(2)])
             for k in range(2)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, os.path.join(root, "scripts", "sm_speeds.py"), "--sms", str(SMS), *a],
        capture_output=True, text=True, timeout=300, cwd=root)
    proc = run("--device", "H200", *paths)
    assert proc.returncode == 0, proc.stderr
    assert "4 one-wave launches on H200 in 2 files" in proc.stdout
    # a line per file, then one per launch
    assert proc.stdout.count("t0.json.gz") == 3 and proc.stdout.count("t1.json.gz") == 3
    assert run("--device", "A100", *paths).returncode == 1
