"""How fast does `agentrl view` start, and how much memory does it hold? Start-up time and resident memory
of the real server (a subprocess), on a small real run folder (by default the checked-in fixture
tests/data/run_v0/run, written by an older agentrl).

Each repeat launches `python -m agentrl view FOLDER --port P` (from an empty temporary directory, so the
checkout in PYTHONPATH, or else the installed agentrl, is the one imported) and times, from the launch:
  overview_s      the first HTTP 200 of GET /api/overview (polled every 50 ms)
  trajectories_s  then the first HTTP 200 of GET /api/trajectories (polled the same way)
then reads the server's resident memory (RSS, children included; /proc/PID/status):
  rss_mb             after those two answers
  rss_trajectory_mb  after GET /api/trajectory/<the first listed episode> (that one loads the tokenizer)
Once per checkout it also measures `python -c "import agentrl.view.server"` (its RSS and wall time) and
names the heavy modules (torch, transformers, ray, ...) in the server's sys.modules: a real `agentrl view`
started in-process through the CLI, probed over HTTP from a thread.

Prints one JSON object: the medians and every value; with --baseline-pythonpath, both checkouts and the
ratios new / baseline of the medians:

    python benchmarks/view_start_bench.py                                      # the code under test, ~15 s
    python benchmarks/view_start_bench.py --baseline-pythonpath /path/to/old   # both, with ratios
    python benchmarks/view_start_bench.py --pythonpath /path/to/old            # another checkout only
    python benchmarks/view_start_bench.py --folder runs/my-run --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import httpx

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "run_v0" / "run"
HEAVY = ("torch", "transformers", "ray", "vllm", "tokenizers", "numpy", "pandas", "matplotlib", "docker")
POLL_S = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(pythonpath: str | None) -> dict[str, str]:
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)
    return env


def poll(client: httpx.Client, path: str, proc: subprocess.Popen, t0: float, timeout: float) -> float:
    """Seconds from t0 to the first HTTP 200 of GET path, polling every 50 ms."""
    while True:
        try:
            if client.get(path).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"agentrl view exited with {proc.returncode} before {path} answered")
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"{path} did not answer within {timeout} s")
        time.sleep(POLL_S)


def start_once(folder: Path, pythonpath: str | None, timeout: float) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as cwd:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentrl", "view", str(folder), "--port", str(port)],
            cwd=cwd,
            env=environment(pythonpath),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
                out = {"overview_s": round(poll(c, "/api/overview", proc, t0, timeout), 3)}
                out["trajectories_s"] = round(poll(c, "/api/trajectories", proc, t0, timeout), 3)
                out["rss_mb"] = harness.tree_rss_mib(proc.pid)
                items = c.get("/api/trajectories").json()["items"]
                if items:
                    t1 = time.perf_counter()
                    c.get(f"/api/trajectory/{items[0]['episode_id']}").raise_for_status()
                    out["trajectory_s"] = round(time.perf_counter() - t1, 3)
                    out["rss_trajectory_mb"] = harness.tree_rss_mib(proc.pid)
            return out
        except Exception:
            proc.kill()
            print(proc.communicate(timeout=10)[1].decode()[-3000:], file=sys.stderr)
            raise
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


# Its own VmRSS read in place, not through harness.proc_kib: the snippet imports nothing but what it measures.
IMPORT_SNIPPET = """
import json, sys, time
t0 = time.perf_counter()
import agentrl.view.server
s = time.perf_counter() - t0
kb = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
print(json.dumps({"import_s": round(s, 3), "rss_mb": round(kb / 1024, 1),
                  "heavy_modules": [m for m in HEAVY if m in sys.modules]}))
"""

# The CLI's own path (`python -m agentrl view`), in this process, probed from a thread once it answers.
SERVER_SNIPPET = """
import json, os, sys, threading, time, urllib.request
folder, port = sys.argv[1], int(sys.argv[2])
def get(path):
    for _ in range(1200):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
                return json.load(r)
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(path)
def probe():
    out = {}
    try:
        get("/api/overview")
        items = get("/api/trajectories")["items"]
        out["after_list"] = [m for m in HEAVY if m in sys.modules]
        if items:
            get("/api/trajectory/" + items[0]["episode_id"])
            out["after_trajectory"] = [m for m in HEAVY if m in sys.modules]
    finally:
        print(json.dumps(out), flush=True)
        os._exit(0)
threading.Thread(target=probe, daemon=True).start()
sys.argv = ["agentrl", "view", folder, "--port", str(port)]
from agentrl.cli import main
main()
"""


def python_json(code: str, args: list[str], pythonpath: str | None, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run(
            [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{code}", *args],
            cwd=cwd,
            env=environment(pythonpath),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if r.returncode != 0:
        raise RuntimeError(f"snippet failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(folder: Path, pythonpath: str | None, repeats: int, timeout: float) -> dict:
    where = python_json("import agentrl; print(__import__('json').dumps(agentrl.__file__))", [], pythonpath, timeout)
    runs = [start_once(folder, pythonpath, timeout) for _ in range(repeats)]
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    return {
        "pythonpath": pythonpath,
        "agentrl": str(Path(where).parent),
        "median": {k: round(statistics.median(r[k] for r in runs), 3) for k in keys},
        "all": {k: [r[k] for r in runs] for k in keys},
        "import_view_server": python_json(IMPORT_SNIPPET, [], pythonpath, timeout),
        "server_heavy_modules": python_json(SERVER_SNIPPET, [str(folder), str(free_port())], pythonpath, timeout),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", type=Path, default=FIXTURE, help="run or evaluation folder (default: the fixture)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pythonpath", help="prepended to the server's PYTHONPATH: measure this checkout")
    p.add_argument("--baseline-pythonpath", help="also measure this checkout, and report the ratios new / baseline")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a start may take before it fails")
    args = p.parse_args()
    folder = args.folder.resolve()
    out = {
        "folder": str(folder),
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    out["new"] = new = measure(folder, args.pythonpath, args.repeats, args.timeout)
    if args.baseline_pythonpath:
        out["baseline"] = base = measure(folder, args.baseline_pythonpath, args.repeats, args.timeout)
        out["ratio_new_over_baseline"] = {
            k: round(new["median"][k] / base["median"][k], 3) for k in new["median"] if base["median"].get(k)
        } | {
            "import_view_server_rss_mb": round(
                new["import_view_server"]["rss_mb"] / base["import_view_server"]["rss_mb"], 3
            )
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
