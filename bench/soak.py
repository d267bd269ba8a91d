"""The service for a long while under mixed load, on SQLite and then on PostgreSQL: does it drift?

    python -m bench.soak [--minutes 30] [--stores sqlite,postgres] [--json results.json]

Per store: the server (``multicomposite serve``, with a token; on PostgreSQL one ``multicomposite worker`` runs the
jobs) on a store of 1,200 matrix entries, and at once:

- ``wrk`` at concurrency 16 over mixed routes (a Lua script cycling GET /select with a cached and a distinct query,
  /ops, /ops/{op}, /matrix pages, /profiles, /healthz, /readyz, /jobs/{id});
- a verify job every minute (POST /verify with the token);
- a CLI writer: ``multicomposite verify --op index_fill --stack vmap`` against the same store every minute, half a
  minute after the job;
- a dashboard-like poller: the page and what it reads, every 2 s.

Reported: every response 5xx (wrk's, the poller's, the job posts') and every request that got no response (a
timeout: 10 s for wrk, 30 s for the others), the server's resident memory every 10 s and its
growth after the first window, the p99 latency of wrk in the first and in the last window (one wrk run each: the
percentile of the window, not an average of percentiles), the jobs' and the CLI runs' outcomes. A window is 5
minutes (half the run when it is shorter than 10). Targets: no 5xx, memory grows at most 5 % after the first
window, the last window's p99 within 1.2x of the first's.

``wrk`` is a Debian/Ubuntu package (``apt-get install wrk``); PostgreSQL's server binaries come from ``postgresql``
(``tests/pgserver.py`` starts a throwaway cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.api import CONCURRENCY, fill_store, rss_mb, serve

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "soak-token"
JOB = {"ops": ["masked_fill"], "stacks": ["vmap"]}
CLI_WRITER = ["-m", "service.cli", "verify", "--op", "index_fill", "--stack", "vmap", "--dtype", "float32"]
POLLED = ("/", "/dashboard/dashboard.js", "/matrix?limit=100", "/profiles", "/ops", "/readyz")

# Mixed routes in turn, per wrk thread; every response's status counted by class. {job} is a job's id.
MIXED_LUA = """
local paths = {
  "/select?op=index_fill&stack=vmap(grad)&batched=value&dtype=float32&numel=1024",
  "/ops/masked_scatter",
  "/healthz",
  "/matrix?limit=100",
  "/select?op=index_add&stack=vmap&dtype=float32&numel=DISTINCT",
  "/ops",
  "/matrix?op=index_fill&limit=50",
  "/profiles",
  "/jobs/{job}",
  "/readyz",
  "/select?op=masked_fill&stack=grad&dtype=float64",
}
local threads = {}
local counter = 1
function setup(thread)
  thread:set("offset", counter * 1000000000)
  counter = counter + 1
  table.insert(threads, thread)
end
function init(args)
  n = offset
  s2, s3, s4, s5 = 0, 0, 0, 0
end
function request()
  n = n + 1
  local path = string.gsub(paths[n % #paths + 1], "DISTINCT", tostring(n))
  return wrk.format("GET", path)
end
function response(status, headers, body)
  if status >= 500 then s5 = s5 + 1 elseif status >= 400 then s4 = s4 + 1
  elseif status >= 300 then s3 = s3 + 1 else s2 = s2 + 1 end
end
function done(summary, latency, requests)
  local t2, t3, t4, t5 = 0, 0, 0, 0
  for _, thread in ipairs(threads) do
    t2 = t2 + thread:get("s2"); t3 = t3 + thread:get("s3"); t4 = t4 + thread:get("s4"); t5 = t5 + thread:get("s5")
  end
  io.write(string.format("SOAK %d %d %d %d %d %d %d\\n", t2, t3, t4, t5, latency:percentile(99),
                         summary.requests, summary.errors.timeout + summary.errors.connect + summary.errors.read
                         + summary.errors.write))
end
"""


@dataclass
class Segment:
    """One wrk run: its start (s into the soak), length, p99 (ms), and responses by status class."""

    start_s: float
    seconds: float
    p99_ms: float
    requests: int
    by_class: dict[str, int]
    socket_errors: int


@dataclass
class Soak:
    store: str
    minutes: float
    window_s: float
    segments: list[Segment] = field(default_factory=list)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (s into the soak, server RSS)
    worker_rss_mb: list[tuple[float, float]] = field(default_factory=list)
    poller: dict[str, int] = field(default_factory=dict)  # status class -> count
    job_posts: dict[str, int] = field(default_factory=dict)  # status code -> count
    jobs: dict[str, int] = field(default_factory=dict)  # final state -> count
    cli_runs: dict[str, int] = field(default_factory=dict)  # exit code -> count
    notes: list[str] = field(default_factory=list)

    def server_5xx(self) -> int:
        """Responses 5xx: wrk's, the poller's, the job posts'."""
        wrk_5xx = sum(s.by_class.get("5xx", 0) for s in self.segments)
        posts_5xx = sum(n for code, n in self.job_posts.items() if code.startswith("5"))
        return wrk_5xx + self.poller.get("5xx", 0) + posts_5xx

    def transport_errors(self) -> int:
        """Requests that got no response: wrk's socket errors (connect, read, write, a 10 s timeout), the poller's
        and the job posts' (a 30 s timeout, a connection reset)."""
        return (sum(s.socket_errors for s in self.segments) + self.poller.get("error", 0)
                + self.job_posts.get("error", 0))

    def rss_growth(self) -> tuple[float, float, float] | None:
        """(RSS at the end of the first window, at the end, growth as a fraction)."""
        after = [mb for t, mb in self.rss_mb if t >= self.window_s]
        if len(after) < 2:
            return None
        return after[0], after[-1], (after[-1] - after[0]) / after[0]


def _wrk(url: str, seconds: float, script: Path) -> tuple[float, int, dict[str, int], int]:
    command = ["wrk", "-t2", f"-c{CONCURRENCY}", f"-d{max(1, round(seconds))}s", "--timeout", "10s", "-s",
               str(script), url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 120)
    found = re.search(r"^SOAK (\d+) (\d+) (\d+) (\d+) (\d+) (\d+) (\d+)$", done.stdout, re.M)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {(done.stderr or done.stdout)[-500:]}")
    s2, s3, s4, s5, p99_us, requests, socket_errors = map(int, found.groups())
    return p99_us / 1000, requests, {"2xx": s2, "3xx": s3, "4xx": s4, "5xx": s5}, socket_errors


def _count(table: dict[str, int], key: str) -> None:
    table[key] = table.get(key, 0) + 1


def _status_class(code: int) -> str:
    return f"{code // 100}xx"


class _Load:
    """The background load beside wrk: the job poster, the CLI writer, the poller, the RSS sampler."""

    def __init__(self, soak: Soak, base: str, env: dict[str, str], server_pid: int, worker_pid: int | None) -> None:
        self.soak, self.base, self.env = soak, base, env
        self.server_pid, self.worker_pid = server_pid, worker_pid
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.job_ids: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=target, daemon=True)
                        for target in (self._jobs, self._cli, self._poll, self._sample)]

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(600)

    def post_job(self, client: httpx.Client) -> str | None:
        try:
            response = client.post(f"{self.base}/verify", json=JOB, headers={"Authorization": f"Bearer {TOKEN}"})
        except httpx.HTTPError:
            with self.lock:
                _count(self.soak.job_posts, "error")
            return None
        with self.lock:
            _count(self.soak.job_posts, str(response.status_code))
        if response.status_code == 202:
            job_id = response.json()["id"]
            self.job_ids.append(job_id)
            return job_id
        return None

    def _jobs(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.wait(60):
                self.post_job(client)

    def _cli(self) -> None:
        if self.stop.wait(30):
            return
        while True:
            done = subprocess.run([sys.executable, *CLI_WRITER], env=self.env, capture_output=True, text=True,
                                  timeout=600, cwd=ROOT)
            with self.lock:
                _count(self.soak.cli_runs, str(done.returncode))
                if done.returncode not in (0, 1):  # 1: verify found a failing composite, the run itself is fine
                    self.soak.notes.append(f"CLI writer exit {done.returncode}: "
                                           f"{(done.stderr.strip().splitlines() or [''])[-1][:300]}")
            if self.stop.wait(60):
                return

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.wait(2):
                paths = [*POLLED, *(f"/jobs/{job}" for job in self.job_ids[-3:])]
                for path in paths:
                    try:
                        code = client.get(self.base + path).status_code
                    except httpx.HTTPError:
                        key = "error"
                    else:
                        key = _status_class(code)
                    with self.lock:
                        _count(self.soak.poller, key)

    def _sample(self) -> None:
        while True:
            now = self.elapsed()
            try:
                self.soak.rss_mb.append((round(now, 1), round(rss_mb(self.server_pid), 1)))
                if self.worker_pid is not None:
                    self.soak.worker_rss_mb.append((round(now, 1), round(rss_mb(self.worker_pid), 1)))
            except (OSError, RuntimeError):  # the process ended: the soak's end says so
                return
            if self.stop.wait(10):
                return


def _final_states(base: str, job_ids: list[str], soak: Soak, wait_s: float = 300) -> None:
    """Wait for the posted jobs to end (a job posted last may still run), then count their states."""
    deadline = time.monotonic() + wait_s
    with httpx.Client(timeout=30) as client:
        for job_id in job_ids:
            while True:
                state = client.get(f"{base}/jobs/{job_id}").json().get("state", "unknown")
                if state not in ("queued", "running", "cancelling") or time.monotonic() > deadline:
                    _count(soak.jobs, state)
                    break
                time.sleep(1)


def _windows(minutes: float) -> float:
    return min(300.0, minutes * 60 / 2)


def soak_one(store: str, minutes: float, folder: Path) -> Soak:
    """One soak of ``minutes`` on ``store`` ("sqlite" or "postgres")."""
    pg = None
    if store == "sqlite":
        url = f"sqlite:///{folder}/soak.db"
    else:
        sys.path.insert(0, str(ROOT))
        from registry.store.migrate import upgrade
        from tests.pgserver import PostgresServer

        pg = PostgresServer().start()
        url = pg.create_database()
        upgrade(url)
    fill_store(url)
    env = {key: value for key, value in os.environ.items() if not key.startswith("MULTICOMPOSITE_")}
    env.update({"PYTHONPATH": str(ROOT), "MULTICOMPOSITE_DB": url, "MULTICOMPOSITE_TOKEN": TOKEN})
    window = _windows(minutes)
    soak = Soak(store=store, minutes=minutes, window_s=window)
    worker = None
    server, base = serve(["-m", "service.cli", "serve"], env, "/healthz")
    try:
        if pg is not None:
            worker = subprocess.Popen([sys.executable, "-m", "service.cli", "worker"], env=env, cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        load = _Load(soak, base, env, server.pid, worker.pid if worker is not None else None)
        with httpx.Client(timeout=30) as client:
            first_job = load.post_job(client) or "none"
        script = folder / "mixed.lua"
        script.write_text(MIXED_LUA.replace("{job}", first_job))
        load.start()
        total = minutes * 60
        plan = [window]  # the first window, one wrk run; then one-minute runs; the last window, one run
        middle = total - 2 * window
        while middle > 1:
            plan.append(min(60.0, middle))
            middle -= plan[-1]
        plan.append(window)
        for seconds in plan:
            start = load.elapsed()
            p99, requests, by_class, socket_errors = _wrk(base + "/healthz", seconds, script)
            soak.segments.append(Segment(round(start, 1), seconds, p99, requests, by_class, socket_errors))
            print(f"  {store} {start / 60:5.1f} min: {requests:,} requests in {seconds:.0f} s, p99 {p99:.1f} ms, "
                  f"{by_class}, RSS {soak.rss_mb[-1][1] if soak.rss_mb else '?'} MB", file=sys.stderr, flush=True)
        load.finish()
        _final_states(base, load.job_ids, soak)
    finally:
        for process in (server, worker):
            if process is not None:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if pg is not None:
            pg.stop()
    return soak


def report(soak: Soak) -> bool:
    """Print one store's figures against the targets; whether every target is met."""
    first, last = soak.segments[0], soak.segments[-1]
    ratio = last.p99_ms / first.p99_ms if first.p99_ms else float("inf")
    errors = soak.server_5xx()
    growth = soak.rss_growth()
    requests = sum(s.requests for s in soak.segments)
    window_min = soak.window_s / 60
    print(f"soak, {soak.store}, {soak.minutes:g} min, wrk concurrency {CONCURRENCY} over mixed routes, a verify "
          f"job a minute, a CLI writer, a poller")
    print(f"    wrk: {requests:,} requests; by class {_summed([s.by_class for s in soak.segments])}; socket errors "
          f"{sum(s.socket_errors for s in soak.segments)}")
    print(f"    5xx responses (wrk, poller, job posts): {errors} (target 0) {'met' if errors == 0 else 'MISSED'}; "
          f"requests without a response (timeouts, resets): {soak.transport_errors()}")
    print(f"    p99 first {window_min:g} min {first.p99_ms:.1f} ms, last {window_min:g} min {last.p99_ms:.1f} ms: "
          f"{ratio:.2f}x (target <= 1.2x) {'met' if ratio <= 1.2 else 'MISSED'}")
    if growth is None:
        print("    RSS: too few samples after the first window")
        grew_ok = False
    else:
        start, end, grew = growth
        grew_ok = grew <= 0.05
        print(f"    server RSS after the first {window_min:g} min {start:.0f} MB -> end {end:.0f} MB "
              f"({grew * 100:+.1f} %, target <= 5 %) {'met' if grew_ok else 'MISSED'}; first sample "
              f"{soak.rss_mb[0][1]:.0f} MB")
    if soak.worker_rss_mb:
        print(f"    worker RSS {soak.worker_rss_mb[0][1]:.0f} MB -> {soak.worker_rss_mb[-1][1]:.0f} MB")
    print(f"    poller {soak.poller}; job posts {soak.job_posts}; jobs {soak.jobs}; CLI runs by exit code "
          f"{soak.cli_runs}")
    for note in soak.notes[:5]:
        print(f"    note: {note}")
    return errors == 0 and ratio <= 1.2 and grew_ok


def _summed(tables: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for table in tables:
        for key, value in table.items():
            total[key] = total.get(key, 0) + value
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long each store is soaked (default 30)")
    parser.add_argument("--stores", default="sqlite,postgres", help="comma-separated: sqlite, postgres")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if unknown := [s for s in stores if s not in ("sqlite", "postgres")]:
        parser.error(f"--stores: unknown {', '.join(unknown)}; stores are sqlite, postgres")
    if args.minutes < 2:
        parser.error("--minutes: at least 2 (a first and a last window of a minute)")
    if shutil.which("wrk") is None:
        print("python -m bench.soak: wrk is not installed: apt-get install wrk (Debian/Ubuntu) or brew install wrk",
              file=sys.stderr)
        return 2
    results, met = [], True
    for store in stores:
        with tempfile.TemporaryDirectory(prefix="multicomposite-soak-") as folder:
            try:
                soak = soak_one(store, args.minutes, Path(folder))
            except RuntimeError as error:
                print(f"python -m bench.soak: {store}: {error}", file=sys.stderr)
                return 2
        met &= report(soak)
        results.append(asdict(soak))
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=1))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())

