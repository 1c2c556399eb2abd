"""scripts/bench_api.py --processes: several API processes only on PostgreSQL (as `wavefarm serve`), the
API's CPU counted over its whole process tree. (The benchmark itself starts real services and takes
minutes: it is run by hand, see docs/SCALING.md.)"""

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import bench_api  # noqa: E402


def test_several_processes_are_refused_on_sqlite_and_with_the_profiler(
        capsys: pytest.CaptureFixture[str]) -> None:
    for argv, reason in ((["--processes", "2"], "needs --backends postgres"),
                         (["--processes", "2", "--backends", "postgres", "--profile"], "one API process"),
                         (["--processes", "0", "--backends", "postgres"], "at least 1")):
        with pytest.raises(SystemExit) as exited:
            bench_api.main(argv)
        assert exited.value.code == 2 and reason in capsys.readouterr().err


def test_the_api_cpu_includes_its_child_processes() -> None:
    burn = ("import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
            "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"])
    try:
        deadline = time.monotonic() + 120
        while bench_api.cpu_seconds(parent.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert bench_api.cpu_seconds(parent.pid) >= 0.5  # the parent itself only waits
    finally:
        parent.kill()
        parent.wait()
