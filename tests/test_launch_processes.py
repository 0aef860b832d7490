"""The launcher ends only what it started: process bookkeeping checked with dummy `sleep` processes (no Flower)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from fedrec_flwr.launch import (
    PROJECT_ROOT,
    RECORD_FILE,
    TOKEN_ENV,
    HomeBusy,
    alive,
    ancestors,
    claim_home,
    run_processes,
    start_time,
    stop_main,
    stop_recorded_superlink,
    terminate,
)


def _sleep(env_extra=None, name=None, new_session=True):
    """A `sleep 300` (named `name` in its command line if given), in its own session by default."""
    command = ["bash", "-c", f"exec -a {name} sleep 300" if name else "exec sleep 300"]
    return subprocess.Popen(command, env={**os.environ, **(env_extra or {})}, start_new_session=new_session)


def _wait_exec(process, word):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if word in open(f"/proc/{process.pid}/cmdline").read():
                return
        except OSError:
            pass
        time.sleep(0.05)


@pytest.fixture
def cleanup():
    started = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_terminate_never_signals_this_process_or_its_ancestors(cleanup):
    victim = _sleep()
    cleanup.append(victim)
    assert os.getppid() in ancestors() and os.getpid() in ancestors()
    signalled = terminate({victim.pid, os.getpid(), os.getppid()}, timeout=5)
    assert signalled == {victim.pid}
    victim.wait(timeout=5)
    assert alive(os.getppid())


def test_stop_spares_a_bystander_and_the_parent_sharing_flwr_home(tmp_path):
    """`FLWR_HOME=dir bash -c 'sleep 300 & launch stop; echo survived'`: the shell and the sleep survive."""
    home = tmp_path / "home"
    script = (
        f"sleep 300 & S=$!; {sys.executable} -m fedrec_flwr.launch stop; rc=$?; "
        "kill -0 $S && echo bystander-alive; kill $S; echo parent-survived $rc"
    )
    done = subprocess.run(
        ["bash", "-c", script],
        env={**os.environ, "FLWR_HOME": str(home)},
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "bystander-alive" in done.stdout and "parent-survived 0" in done.stdout, done.stdout + done.stderr


def test_a_recorded_superlink_is_stopped_with_its_group_and_token_but_nothing_else(tmp_path, cleanup):
    home = tmp_path / "home"
    (home / RECORD_FILE).parent.mkdir(parents=True)
    token = uuid.uuid4().hex
    link = _sleep({TOKEN_ENV: token, "FLWR_HOME": str(home)}, name="flower-superlink")
    ray_daemon = _sleep({TOKEN_ENV: token})  # left the SuperLink's group, as Ray's daemons do
    bystander = _sleep({"FLWR_HOME": str(home)})
    cleanup += [link, ray_daemon, bystander]
    _wait_exec(link, "flower-superlink")
    (home / RECORD_FILE).write_text(json.dumps({"pid": link.pid, "start-time": start_time(link.pid), "token": token}))
    signalled = stop_recorded_superlink(home, timeout=5)
    assert set(signalled) == {link.pid, ray_daemon.pid}
    link.wait(timeout=5), ray_daemon.wait(timeout=5)
    assert bystander.poll() is None
    assert not (home / RECORD_FILE).exists()


def test_a_record_whose_pid_was_reused_is_not_acted_on(tmp_path, cleanup):
    """Same PID but another start time, or not a SuperLink: not the recorded process, left alone."""
    home = tmp_path / "home"
    (home / RECORD_FILE).parent.mkdir(parents=True)
    other = _sleep({"FLWR_HOME": str(home)}, name="flower-superlink")
    plain = _sleep({"FLWR_HOME": str(home)})
    cleanup += [other, plain]
    _wait_exec(other, "flower-superlink")
    for record in (
        {"pid": other.pid, "start-time": start_time(other.pid) - 1, "token": ""},
        {"pid": plain.pid, "start-time": start_time(plain.pid), "token": ""},
    ):
        (home / RECORD_FILE).write_text(json.dumps(record))
        assert stop_recorded_superlink(home, timeout=5) == []
    assert other.poll() is None and plain.poll() is None


def test_concurrent_launchers_get_separate_homes_or_a_refusal_naming_the_holder(tmp_path):
    base = tmp_path / "home"
    with claim_home(base) as (first, others_first):
        assert first == base.resolve() and others_first == []
        with claim_home(base) as (second, others_second):
            assert second == base.resolve() / "concurrent-1"
            assert f"launcher pid {os.getpid()}" in others_second[0]
            with pytest.raises(HomeBusy, match=f"launcher pid {os.getpid()}"):
                with claim_home(base, max_slots=2):
                    pass
    with claim_home(base) as (again, _):  # released when the holder ended
        assert again == base.resolve()


def test_stop_leaves_a_running_launchers_superlink_alone(tmp_path, cleanup, capsys):
    base = tmp_path / "home"
    with claim_home(base) as (home, _):
        (home / RECORD_FILE).parent.mkdir(parents=True, exist_ok=True)
        link = _sleep(name="flower-superlink")
        cleanup.append(link)
        _wait_exec(link, "flower-superlink")
        (home / RECORD_FILE).write_text(json.dumps({"pid": link.pid, "start-time": start_time(link.pid), "token": ""}))
        assert stop_main(str(base)) == 0
        assert link.poll() is None
        assert "a run is in progress" in capsys.readouterr().out
    assert stop_main(str(base)) == 0  # its launcher is gone: now the recorded SuperLink is stopped
    link.wait(timeout=10)


def test_run_processes_finds_a_daemon_that_lost_the_token_by_its_session(cleanup):
    """A Ray daemon that rewrote its environment (no token left) is found as a member of a session our process
    leads, also after the leader exited; a process of this test's own session is never included."""
    token = uuid.uuid4().hex
    leader = subprocess.Popen(
        ["bash", "-c", f"env -u {TOKEN_ENV} sleep 300 & echo $!; wait"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, TOKEN_ENV: token},
        start_new_session=True,
    )
    bystander = _sleep({TOKEN_ENV: "another-run"}, new_session=False)
    cleanup += [leader, bystander]
    daemon = int(leader.stdout.readline())
    try:
        sessions: set[int] = set()
        assert {leader.pid, daemon} <= run_processes(token, (), sessions)
        assert bystander.pid not in run_processes(token, (), sessions)
        leader.kill()
        leader.wait()
        assert daemon in run_processes(token, (), sessions)  # the leader is gone; its session still names it
        assert terminate(run_processes(token, (), sessions), timeout=5) == {daemon}
    finally:
        if alive(daemon):
            os.kill(daemon, 9)
