"""A worker across a boundary: started through a command of its own, sharing nothing with the app but
the protocol. Two stand-ins for WSL2's VM and a headless GPU rig: a worker in its own mount, PID and
network namespace (the network lab), and a worker over a real ``sshd`` on 127.0.0.1. Each trains,
pauses and resumes through the protocol, and reports its stats and log lines; its files stay on its
side. Killing the launcher (the ssh client) stops the worker on the far side."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import psutil
import pytest
from conftest import tiny_experiment
from test_worker import collect_until, describe, is_state, start_training, states, wait_exit

from dedloc_core.protocol import Limits, Pause, Resume, Start
from dedloc_core.workerproc import WorkerProcess

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def start(data_url: str) -> Start:
    return Start(experiment=tiny_experiment(), initial_peers=[], data_base_url=data_url, identity_path=None,
                 progress_period=0.5, limits=Limits(cpu_threads=1))


def app_env(tmp_path: Path) -> dict[str, str]:
    """The app's environment: its own data folder, which the far worker must not touch."""
    return {**os.environ, "DEDLOC_HOME": str(tmp_path / "app"), "DEDLOC_LOG_LEVEL": "WARNING"}


def train_pause_resume(worker: WorkerProcess, command: Start) -> None:
    """What the app does with any worker: start, read stats, pause and resume by command, stop."""
    events = start_training(worker, command)
    assert [e for e in events if e.type == "log"], "no log line came through the protocol: " + str(describe(events))
    batch = command.experiment["batch_size_per_step"]
    stats = collect_until(worker, lambda e: e.type == "stats" and e.samples >= 10 * batch, 60)[-1]
    assert stats.compute_seconds > 0 and stats.device == "cpu"
    assert not worker.freeze(), "a signal was sent across the boundary"
    assert worker.send(Pause(reason="user"))
    paused = collect_until(worker, is_state("paused"), 10)
    at_pause = max([e.samples for e in paused if e.type == "stats"], default=stats.samples)
    time.sleep(2.0)
    quiet = []
    while not worker.events.empty():
        quiet.append(worker.events.get_nowait())
    assert not [e for e in quiet if e.type == "stats" and e.samples > at_pause + batch], describe(quiet)
    assert worker.send(Resume())
    collect_until(worker, is_state("training"), 10)
    later = collect_until(worker, lambda e: e.type == "stats" and e.samples >= at_pause + 5 * batch, 30)[-1]
    assert later.paused_seconds >= 2.0, later


def test_a_worker_in_its_own_namespaces_trains_and_pauses_through_the_protocol(netlab, tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    data = netlab.public("data")
    site = tmp_path / "site"  # the shards under data/, as the experiment names them
    site.mkdir()
    with resources.as_file(resources.files("resources").joinpath("corpus")) as corpus:
        (site / "data").symlink_to(corpus)
        netlab.popen(data, [sys.executable, "-m", "http.server", "--bind", data.ip, "8000", "--directory",
                            str(site)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        volunteer = netlab.home("volunteer")
        # its own mount namespace with an empty folder of its own (its data, its sockets: a tmpfs that
        # only it sees; not /tmp, where this checkout may live), its own PID namespace (sh is its
        # init), the volunteer's network namespace: only the data host is reachable
        far = tmp_path / "far"
        far.mkdir()
        inner = (f"mount -t tmpfs tmpfs {far} && cd {far} && DEDLOC_HOME={far} HOME={far} TMPDIR={far} "
                 f"DEDLOC_LOG_LEVEL=INFO {sys.executable} -m dedloc_core.engine.worker")
        command = [*netlab.launcher(volunteer), "unshare", "--mount", "--pid", "--fork", "--mount-proc",
                   "--propagation", "private", "sh", "-c", inner]
        worker = WorkerProcess(command=command, env=app_env(tmp_path), stderr=open(tmp_path / "worker.log", "w"))
        try:
            hello = worker.start(hello_timeout=60)
            assert hello.pid < 50 and hello.pid != worker.pid, "the worker is not in a PID namespace of its own"
            assert worker.socket_dir is None and worker.where().startswith("through ip netns exec")
            train_pause_resume(worker, start(f"http://{data.ip}:8000/"))
            assert worker.stop(timeout=30).name == "OK"
        finally:
            worker.kill()
    assert not (tmp_path / "app").exists(), list((tmp_path / "app").rglob("*"))  # nothing of it on our side
    assert not list(far.iterdir()), list(far.iterdir())  # its files were in its own mount only


@pytest.fixture
def sshd(tmp_path):
    """A real sshd on 127.0.0.1 that lets in one key as root; yields the ssh command prefix."""
    daemon, keygen = shutil.which("sshd") or "/usr/sbin/sshd", shutil.which("ssh-keygen")
    if not os.path.exists(daemon) or keygen is None or shutil.which("ssh") is None:
        pytest.skip("needs openssh-server and openssh-client (apt-get install openssh-server)")
    if os.geteuid() != 0:
        pytest.skip("sshd here logs in as root")
    folder = tmp_path / "ssh"
    folder.mkdir()
    for key in ("host", "user"):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(folder / key)], check=True)
    shutil.copy(folder / "user.pub", folder / "authorized_keys")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (folder / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {folder / 'host'}\nPidFile {folder / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {folder / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n")
    os.makedirs("/run/sshd", exist_ok=True)  # its privilege separation folder
    proc = subprocess.Popen([daemon, "-D", "-e", "-f", str(folder / "sshd_config")],
                            stdout=subprocess.DEVNULL, stderr=open(folder / "sshd.log", "w"))
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("sshd did not start: " + (folder / "sshd.log").read_text()[-2000:])
                time.sleep(0.1)
        yield ["ssh", "-F", "/dev/null", "-i", str(folder / "user"), "-p", str(port), "-o", "BatchMode=yes",
               "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
               "root@127.0.0.1"]
    finally:
        proc.terminate()
        proc.wait(10)


def far_workers(home: Path) -> list[psutil.Process]:
    """The far side's worker processes, found by the data folder the remote command gave them."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("DEDLOC_HOME") == str(home):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def test_a_worker_over_ssh_trains_pauses_and_dies_with_its_launcher(sshd, corpus_server, tmp_path):
    far = tmp_path / "rig"  # the rig's data folder: only the remote command names it
    remote = (f"cd {ROOT} && DEDLOC_HOME={far} DEDLOC_LOG_LEVEL=INFO exec {sys.executable} "
              "-m dedloc_core.engine.worker")
    worker = WorkerProcess(command=[*sshd, remote], env=app_env(tmp_path), stderr=open(tmp_path / "worker.log", "w"))
    try:
        hello = worker.start(hello_timeout=60)
        assert hello.host == socket.gethostname() and worker.where().startswith("through ssh ")
        train_pause_resume(worker, start(corpus_server.url))
        assert (far / "data" / "identity.key").exists() and not (tmp_path / "app").exists()  # its identity is its own
        assert far_workers(far), "no worker on the far side"

        worker.kill()  # the launcher dies: for the app, the worker died
        assert wait_exit(worker) != 0
        tail = []
        while (event := worker.events.get(timeout=10)) is not None:
            tail.append(event)
        assert "stopped" not in states(tail), describe(tail)  # it did not say goodbye: the link is gone
        deadline = time.monotonic() + 30  # and the far worker, its stdin gone, stops on its own
        while far_workers(far) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not far_workers(far), [p.cmdline() for p in far_workers(far)]
    finally:
        worker.kill()
        for proc in far_workers(far):
            proc.kill()
