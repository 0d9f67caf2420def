"""bench/gpu_jobs.py: the GPU suite's job pool runs jobs in parallel, serialises the timed sections, keeps
what a killed job wrote, and reports the jobs the time budget left out."""

from __future__ import annotations

import itertools
import time

from bench.gpu_jobs import Job, run_jobs

# A job that records when it held the lock; "sleep" is how long it holds it.
HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from bench.gpu_jobs import emit, gpu_lock, past_deadline
with gpu_lock():
    t0 = time.time(); time.sleep({sleep}); emit({{"start": t0, "end": time.time(), "late": past_deadline()}})
"""


def _job(name: str, sleep: float, root: str) -> Job:
    return Job(name, ["-c", HOLD.format(root=root, sleep=sleep)])


def test_timed_sections_never_overlap_and_rows_come_back(tmp_path, request):
    root = str(request.config.rootpath)
    jobs = [_job(f"j:{i}", 0.3, root) for i in range(3)]
    t0 = time.time()
    done = run_jobs(jobs, workers=3, soft_end=t0 + 60, hard_end=t0 + 90, tmp=tmp_path, compile_threads=1,
                    log=lambda s: None)  # fmt: skip
    assert all(d["status"] == "ok" for d in done.values()), done
    spans = sorted((d["rows"][0]["start"], d["rows"][0]["end"]) for d in done.values())
    assert len(spans) == 3 and all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert not any(d["rows"][0]["late"] for d in done.values())


def test_budget_kills_late_jobs_keeps_their_rows_and_reports_the_rest(tmp_path, request):
    root = str(request.config.rootpath)
    slow = Job("slow", ["-c", f"import sys; sys.path.insert(0, {root!r})\nfrom bench.gpu_jobs import emit\n"
                              "import time\nemit({'first': 1}); time.sleep(60)"])  # fmt: skip
    t0 = time.time()
    done = run_jobs([slow, _job("queued", 0.0, root)], workers=1, soft_end=t0 + 1.5, hard_end=t0 + 3,
                    tmp=tmp_path, compile_threads=1, log=lambda s: None)  # fmt: skip
    assert time.time() - t0 < 20
    assert done["slow"]["status"].startswith("killed") and done["slow"]["rows"] == [{"first": 1}]
    assert done["queued"]["status"].startswith("not run") and done["queued"]["rows"] == []


def test_a_failing_job_is_a_status_with_its_output(tmp_path):
    t0 = time.time()
    done = run_jobs([Job("bad", ["-c", "raise SystemExit('no CUDA here')"])], workers=1, soft_end=t0 + 30,
                    hard_end=t0 + 40, tmp=tmp_path, compile_threads=1, log=lambda s: None)  # fmt: skip
    assert done["bad"]["status"] == "exit 1" and "no CUDA here" in done["bad"]["log_tail"]
