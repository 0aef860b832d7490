"""Soak test: a long ``flwr run`` simulation with its memory sampled all along, to see whether it grows round to round
and whether any reply is lost.

Run by hand (not a test), e.g.::

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench/soak.py --dataset amazon-video --users-per-node 1 \
        --rounds 20 --fraction-train 0.1 --fraction-evaluate 0.1 --eval-every 10

It runs the app exactly as ``python -m fedrec_flwr.launch run`` does (``fedrec_flwr.launch.flwr_run``: a fresh local
SuperLink with its own ``FLWR_HOME`` and free ports, Flower's Ray simulation, one SuperNode per ``users-per-node``
users), and every ``--interval`` seconds sums the resident memory (RSS) of every process of the run: all members of
the SuperLink's session and of the session of every process that has the run's ``FLWR_HOME`` in its environment (the
simulation process runs in a session of its own with Ray's daemons and client actors; Ray changes their process
group, never their session), and the ``flwr run`` command itself. Samples are assigned to rounds by watching the
results folder: ``config.json`` appears when training starts (after the SuperNodes registered and answered the
identify query) and ``metrics.json`` gains one row at the end of each round, whose ``seconds`` is the round's wall
time measured by the ServerApp.

It prints and writes (``--out-dir``, default ``experiments/bench/results/``: ``soak-<dataset>-upn<k>.json`` and
``.csv``, rewritten atomically after every round, so a run killed midway leaves the rounds it finished) one row per
round: wall seconds, replies (and the number expected from the seeded user sampling), failures, users
trained / evaluated, peak and lowest summed RSS (GiB) during the round and the peak summed PSS (RSS with shared
pages split between the processes that map them; sampled every ``--pss-every`` seconds only, as reading it costs
about a second of CPU). Then: the overall peak, a least-squares slope of the per-round peak and lowest RSS over
rounds 5..N (training-only rounds, so evaluation rounds do not bias it), how far apart the per-round peaks of rounds
5..N are (``peak-rss-spread-from-round-5-percent``, evaluation rounds included: the memory target is at most 1%), and
whether any reply was lost. RSS sums
count pages shared between processes (libraries, Ray's object store) once per process, so they overstate the
machine's use; PSS does not.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fedrec_flwr.io import atomic_write_json, atomic_write_text  # noqa: E402
from fedrec_flwr.launch import alive, flwr_env, flwr_run, processes_with_env, superlink_pids  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
GIB = 2**30


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stat(pid: int) -> list[str]:
    return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1]).split()


class RunProcesses:
    """Finds the processes of the run: every member of the sessions of the SuperLink and of the processes that carry
    the run's ``FLWR_HOME`` (the SuperLink starts the simulation in a session of its own, and a Ray process that sets a
    long title, such as ``ray::DashboardAgent``, overwrites the start of its ``/proc/<pid>/environ``), plus this
    process's descendants (the ``flwr run`` command); never this process or its own session."""

    def __init__(self, flwr_home: str, env_every: float = 5.0) -> None:
        self.flwr_home = flwr_home
        self.env_every = env_every
        self.sessions: set[int] = set()
        self._with_env: set[int] = set()
        self._env_scanned = -1e9

    def __call__(self, superlinks: list[int]) -> set[int]:
        me, my_session = os.getpid(), os.getsid(0)
        now = time.monotonic()
        if now - self._env_scanned >= self.env_every:  # reading every environment is the costly part
            self._with_env = set(processes_with_env("FLWR_HOME", self.flwr_home))
            self._env_scanned = now
        self.sessions.update(superlinks)
        parent: dict[int, int] = {}
        session: dict[int, int] = {}
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    fields = _stat(int(proc.name))
                except (OSError, IndexError):
                    continue
                parent[int(proc.name)], session[int(proc.name)] = int(fields[1]), int(fields[3])
        self.sessions.update(session[p] for p in self._with_env if p in session)
        self.sessions.discard(my_session)
        found = {p for p, sid in session.items() if sid in self.sessions} | (self._with_env & set(session))
        for pid in parent:  # descendants of this process
            ancestor, hops = parent.get(pid), 0
            while ancestor and ancestor != 1 and hops < 64:
                if ancestor == me:
                    found.add(pid)
                    break
                ancestor, hops = parent.get(ancestor), hops + 1
        found.discard(me)
        return found


def rss_bytes(pids: set[int]) -> tuple[int, int]:
    """(summed RSS bytes, processes counted) of the live processes among ``pids`` (``/proc/<pid>/statm``: cheap)."""
    rss = count = 0
    for pid in pids:
        try:
            rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
            count += 1
        except (OSError, IndexError, ValueError):
            continue
    return rss, count


def rss_by_process(pids: set[int]) -> dict[str, float]:
    """RSS in MiB summed per program (the process title's first word: ``flwr-simulation``, ``ray::ClientAppActor``,
    ``raylet``, ...)."""
    out: dict[str, float] = {}
    for pid in pids:
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split()
            rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            continue
        program = next((w for w in words if not w.endswith(("python", "python3")) and not w.startswith("-")), "?")
        label = program.split("/")[-1].split(".")[0] if not program.startswith("ray::") else program.split(".")[0]
        out[label] = round(out.get(label, 0.0) + rss / 2**20, 1)
    return dict(sorted(out.items(), key=lambda item: -item[1]))


def pss_bytes(pids: set[int]) -> int:
    """Summed PSS bytes of ``pids`` (``/proc/<pid>/smaps_rollup``: about a second for this run's big processes on a
    loaded 2-core machine, so it is sampled less often)."""
    pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
                    break
        except (OSError, IndexError, ValueError):
            continue
    return pss


def _read_rows(folder: Path) -> list[dict] | None:
    try:
        return json.loads((folder / "metrics.json").read_text())
    except (OSError, ValueError):
        return None


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``y`` over ``x``."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else None


def spread_percent(values: list[float]) -> float | None:
    """``(max / min - 1) * 100`` of positive ``values`` (how far apart the per-round peaks are), ``None`` without
    values."""
    values = [v for v in values if v > 0]
    return (max(values) / min(values) - 1.0) * 100.0 if values else None


def expected_counts(config, num_users: int) -> dict[int, dict[str, int]]:
    """Per round: replies (nodes of the sampled users), users the seeded sampling gives to train and evaluate, and
    users visited so far."""
    import numpy as np

    from fedrec_flwr.wire import sample_users

    upn = config.users_per_node
    out = {}
    visited = np.zeros(num_users, dtype=bool)
    for rnd in range(1, config.num_server_rounds + 1):
        train = sample_users(config.seed, rnd, num_users, config.fraction_train, tag=0)
        row = {"replies": int(len(np.unique(train // upn))), "train-users": int(len(train))}
        visited[train] = True
        if config.fraction_evaluate > 0 and (rnd % config.eval_every == 0 or rnd == config.num_server_rounds):
            evaluated = sample_users(config.seed, rnd, num_users, config.fraction_evaluate, tag=1)
            row["eval-users"] = int(len(evaluated))
            visited[evaluated] = True
        row["visited-users"] = int(visited.sum())  # users sent at least one message so far (their state exists)
        row["visited-nodes"] = int(len(np.unique(np.flatnonzero(visited) // upn)))  # nodes whose Context came back
        out[rnd] = row
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="amazon-video")
    parser.add_argument("--data-root", default=os.environ.get("FEDREC_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    parser.add_argument("--users-per-node", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--fraction-train", type=float, default=0.1)
    parser.add_argument("--fraction-evaluate", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--client-cpus",
        type=float,
        default=None,
        help="CPUs per client actor (federation config client-resources-num-cpus; Flower's default: 2)",
    )
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between RSS samples")
    parser.add_argument("--pss-every", type=float, default=30.0, help="seconds between PSS samples (0 = none)")
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="stop the run after this many seconds")
    parser.add_argument("--retries", type=int, default=3, help="retries of a run that fails before training starts")
    parser.add_argument("--out-dir", default=str(ROOT / "experiments" / "bench" / "results"))
    parser.add_argument("--name", default=None, help="output file stem (default soak-<dataset>-upn<k>)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more run-config overrides (TOML)")
    args = parser.parse_args()

    import tomllib

    from fedrec_flwr.app.runtime import load_split_for
    from fedrec_flwr.config import make_run_config

    work = Path(tempfile.mkdtemp(prefix="fedrec-soak-"))
    overrides = {
        "dataset": args.dataset,
        "data-dir": str(Path(args.data_root).resolve() / args.dataset),
        "users-per-node": args.users_per_node,
        "num-server-rounds": args.rounds,
        "fraction-train": args.fraction_train,
        "fraction-evaluate": args.fraction_evaluate,
        "eval-every": args.eval_every,
        "seed": args.seed,
        "results-dir": str(work / "results"),
        "run-name": "soak",
    }
    for pair in args.set:
        key, _, value = pair.partition("=")
        overrides[key.strip()] = tomllib.loads(f"v = {value}")["v"]
    config = make_run_config(**overrides)
    num_users = load_split_for(config).num_users
    expected = expected_counts(config, num_users)
    num_nodes = -(-num_users // args.users_per_node)
    folder = work / "results" / "soak"
    flwr_home = str(work / "flwr-home")
    ports = {"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()), "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port())}
    env = flwr_env(flwr_home, ports)
    federation = {"client-resources-num-cpus": args.client_cpus} if args.client_cpus else {}
    print(
        f"soak: {args.dataset}, {num_users} users, {num_nodes} SuperNodes, {args.rounds} rounds; work dir {work}",
        flush=True,
    )

    outcome: dict = {}

    def run() -> None:
        # `flwr run` gives its local SuperLink 15 s to start (a constant of flwr 1.42), which a loaded machine can
        # miss: a run that fails within 3 minutes without starting to train is tried again.
        for attempt in range(1, args.retries + 2):
            tried = time.monotonic()
            try:
                done = flwr_run(
                    overrides,
                    num_supernodes=num_nodes,
                    flwr_home=flwr_home,
                    env_extra=ports,
                    timeout=args.timeout,
                    federation_config=federation,
                )
                outcome["returncode"] = done.returncode
            except BaseException as error:  # noqa: BLE001 - reported below
                outcome["error"] = repr(error)
                return
            outcome["attempts"] = attempt
            if done.returncode == 0 or (folder / "config.json").exists() or time.monotonic() - tried > 180:
                return
            print(f"soak: flwr run failed before training (attempt {attempt}); trying again", flush=True)
            time.sleep(5)

    out = Path(args.out_dir)
    stem = args.name or f"soak-{args.dataset}-upn{args.users_per_node}"
    samples: list[tuple[float, int, int]] = []  # (seconds since start, summed RSS, processes)
    pss_samples: list[tuple[float, int]] = []  # (seconds since start, summed PSS), every --pss-every seconds
    round_end: dict[int, float] = {}
    round_load: dict[int, float] = {}  # the machine's 1-minute load average when the round ended
    round_programs: dict[int, dict[str, float]] = {}  # RSS MiB per program when the round ended
    state: dict = {"train-start": None, "cost": 0.0, "leftover": None}

    def report(now: float, complete: bool) -> tuple[list[dict], dict]:
        """The per-round table and the summary from what was sampled until ``now`` (seconds since the start)."""
        rows = _read_rows(folder) or []
        table = []
        for row in rows:
            rnd = int(row["round"])
            end = round_end.get(rnd, now)
            begin = end - float(row["seconds"]) - args.interval
            window = [s for s in samples if begin <= s[0] <= end]
            pss_window = [s for s in pss_samples if begin <= s[0] <= end]
            want = expected.get(rnd, {})
            table.append(
                {
                    "round": rnd,
                    "seconds": float(row["seconds"]),
                    "replies": int(row.get("num-replies", 0)),
                    "expected-replies": want.get("replies"),
                    "failures": int(row.get("num-failures", 0)),
                    "train-users": int(row.get("train-users", 0)),
                    "expected-train-users": want.get("train-users"),
                    "eval-users": int(row["eval-users"]) if "eval-users" in row else None,
                    "expected-eval-users": want.get("eval-users"),
                    "peak-rss-GiB": round(max((s[1] for s in window), default=0) / GIB, 3),
                    "low-rss-GiB": round(min((s[1] for s in window), default=0) / GIB, 3),
                    "peak-pss-GiB": round(max(s[1] for s in pss_window) / GIB, 3) if pss_window else None,
                    "processes": max((s[2] for s in window), default=0),
                    "visited-users": want.get("visited-users"),
                    "visited-nodes": want.get("visited-nodes"),
                    "HR@10": row.get("HR@10"),
                    "load-1min": round_load.get(rnd),
                    "rss-MiB-by-program": round_programs.get(rnd),
                }
            )
        train_start = state["train-start"]
        startup = [s for s in samples if train_start is None or s[0] <= train_start]
        steady = [r for r in table if r["round"] >= 5 and r["eval-users"] is None]
        peak_slope = _slope([(r["round"], r["peak-rss-GiB"] * 1024) for r in steady])
        low_slope = _slope([(r["round"], r["low-rss-GiB"] * 1024) for r in steady])
        lost = [
            r["round"]
            for r in table
            if r["failures"]
            or r["replies"] != r["expected-replies"]
            or r["train-users"] != r["expected-train-users"]
            or r["eval-users"] != r["expected-eval-users"]
        ]
        # "grows": the fitted slope is at least 1 MiB a round. Where it goes: the growth per program, and the nodes
        # visited so far (state kept per node grows until every node was visited, then stops).
        grows = None if peak_slope is None else bool(peak_slope >= 1.0)
        # the memory target: the peak of every round from round 5 on (evaluation rounds included) within 1%
        spread = spread_percent([r["peak-rss-GiB"] for r in table if r["round"] >= 5])
        first, last = (table[0], table[-1]) if table else ({}, {})
        growth_by_program = {
            k: round(v - (first.get("rss-MiB-by-program") or {}).get(k, 0.0), 1)
            for k, v in (last.get("rss-MiB-by-program") or {}).items()
        }
        summary = {
            "complete": complete,
            "dataset": args.dataset,
            "users": num_users,
            "supernodes": num_nodes,
            "users-per-node": args.users_per_node,
            "rounds": args.rounds,
            "completed-rounds": len(rows),
            "fraction-train": args.fraction_train,
            "fraction-evaluate": args.fraction_evaluate,
            "eval-every": args.eval_every,
            "seed": args.seed,
            "client-cpus": args.client_cpus,
            "returncode": outcome.get("returncode"),
            "error": outcome.get("error"),
            "attempts": outcome.get("attempts"),
            "total-seconds": round(now, 1),
            "startup-seconds": round(train_start, 1) if train_start else None,
            "startup-peak-rss-GiB": round(max((s[1] for s in startup), default=0) / GIB, 3),
            "peak-rss-GiB": round(max((s[1] for s in samples), default=0) / GIB, 3),
            "peak-pss-GiB": round(max((s[1] for s in pss_samples), default=0) / GIB, 3),
            "peak-rss-slope-MiB-per-round": round(peak_slope, 2) if peak_slope is not None else None,
            "low-rss-slope-MiB-per-round": round(low_slope, 2) if low_slope is not None else None,
            "slope-rounds": [r["round"] for r in steady],
            "memory-grows": grows,
            "peak-rss-spread-from-round-5-percent": round(spread, 2) if spread is not None else None,
            "flat-within-1%-from-round-5": None if spread is None else bool(spread <= 1.0),
            "rss-MiB-growth-by-program-round1-to-last": growth_by_program,
            "rounds-with-lost-or-failed-replies": lost,
            "samples": len(samples),
            "pss-samples": len(pss_samples),
            "sampler-busy-share": round(state["cost"] / now, 3) if now else None,
            "leftover-processes-killed": state["leftover"],
            "final": json.loads((folder / "summary.json").read_text())["final"]
            if (folder / "summary.json").is_file()
            else None,
        }
        return table, summary

    def write(table: list[dict], summary: dict) -> None:
        """``<stem>.json`` (summary and rounds) and ``<stem>.csv`` (rounds), atomically: a run killed midway leaves
        the rounds it finished."""
        atomic_write_json(out / f"{stem}.json", {"summary": summary, "rounds": table})
        columns = [c for c in (table[0] if table else {"round": 0}) if c != "rss-MiB-by-program"]
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(table)
        atomic_write_text(out / f"{stem}.csv", buffer.getvalue())

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    find = RunProcesses(flwr_home)
    while thread.is_alive():
        tick = time.monotonic()
        now = tick - started
        pids = find(superlink_pids(env))
        rss, count = rss_bytes(pids)
        samples.append((now, rss, count))
        if args.pss_every > 0 and (not pss_samples or now - pss_samples[-1][0] >= args.pss_every):
            pss_samples.append((now, pss_bytes(pids)))
        if state["train-start"] is None and (folder / "config.json").is_file():
            state["train-start"] = now
        new_round = False
        for row in _read_rows(folder) or []:
            if int(row["round"]) not in round_end:
                round_end[int(row["round"])] = now
                round_load[int(row["round"])] = round(os.getloadavg()[0], 2)
                round_programs[int(row["round"])] = rss_by_process(pids)
                new_round = True
        if new_round:
            write(*report(now, complete=False))
        state["cost"] += time.monotonic() - tick
        thread.join(timeout=max(0.05, args.interval - (time.monotonic() - tick)))
    total = time.monotonic() - started
    time.sleep(2.0)
    # the launcher should have ended them all (never PIDs merely seen earlier: they may belong to someone else now)
    state["leftover"] = sorted(pid for pid in find(superlink_pids(env)) if alive(pid))
    for pid in state["leftover"]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    table, summary = report(total, complete=True)
    print(
        "\n| round | wall s | replies (expected) | failures | users trained | users evaluated | nodes visited | "
        "peak RSS GiB | low RSS GiB | peak PSS GiB | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| start-up | {summary['startup-seconds']} | | | | | | {summary['startup-peak-rss-GiB']:.2f} | | | |")
    for r in table:
        evaluated = "" if r["eval-users"] is None else f"{r['eval-users']} ({r['expected-eval-users']})"
        print(
            f"| {r['round']} | {r['seconds']:.1f} | {r['replies']} ({r['expected-replies']}) | {r['failures']} | "
            f"{r['train-users']} ({r['expected-train-users']}) | {evaluated} | {r['visited-nodes']} | "
            f"{r['peak-rss-GiB']:.2f} | "
            f"{r['low-rss-GiB']:.2f} | {r['peak-pss-GiB'] if r['peak-pss-GiB'] is not None else '-'} | "
            f"{r['load-1min']} |"
        )
    print(json.dumps({k: v for k, v in summary.items() if k not in ("final", "slope-rounds")}, indent=1))
    write(table, summary)
    print(f"wrote {out / stem}.json and .csv", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    lost = summary["rounds-with-lost-or-failed-replies"]
    return 0 if outcome.get("returncode") == 0 and summary["completed-rounds"] == args.rounds and not lost else 1


if __name__ == "__main__":
    sys.exit(main())
