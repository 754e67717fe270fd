"""The worker process, for real: protocol handshake and validation, training, pause/resume, stop,
crash cleanup, bad data and bad experiments. No mocks: every test starts ``dedloc_core.engine.worker``
through ``WorkerProcess`` (the ``spawn_worker`` fixture) and talks the JSON-lines protocol to it."""

from __future__ import annotations

import glob
import hashlib
import logging
import math
import os
import queue
import select
import signal
import subprocess
import time
from importlib import resources

import psutil
import pytest
from conftest import CORPUS_MANIFEST, start_command, tiny_experiment
from msgspec.structs import replace

from dedloc_core.engine.channel import EventChannel, EventLogHandler
from dedloc_core.organizer.httpserve import FileServer
from dedloc_core.protocol import MAX_LINE, PROTOCOL_VERSION, Pause, Resume, Start, Stop, decode_event
from dedloc_core.workerproc import StopResult, WorkerProcess

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

START_TIMEOUT = 60.0  # start -> "training": imports torch + hivemind, starts a DHT and p2pd
# Process start -> "training" for a lone worker: nothing to wait for but its own start (imports,
# model, DHT, averagers): 23 s measured beside 3 other helpers' load (load average 20) on 2 cores.
LONE_TRAINING_S = 45.0
EXIT_TIMEOUT = 20.0


# ---- helpers ------------------------------------------------------------------------------------


def next_event(worker: WorkerProcess, timeout: float = 10.0):
    """The next event (None at end of stream); fails the test on timeout."""
    try:
        event = worker.events.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"no event from the worker within {timeout} s")
    if event is None:
        worker.events.put(None)
    return event


def collect_until(worker: WorkerProcess, predicate, timeout: float) -> list:
    """Every event up to and including the first that matches; fails the test if none does."""
    seen: list = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"timed out after {timeout} s; last events: {describe(seen[-8:])}")
        try:
            event = worker.events.get(timeout=left)
        except queue.Empty:
            continue
        if event is None:
            worker.events.put(None)
            pytest.fail(f"the worker's event stream ended first; last events: {describe(seen[-8:])}")
        seen.append(event)
        if predicate(event):
            return seen


def collect_to_end(worker: WorkerProcess, timeout: float) -> list:
    """Every event until the worker closes its event channel (it exited)."""
    seen: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            event = worker.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if event is None:
            worker.events.put(None)
            return seen
        seen.append(event)
    pytest.fail(f"the event stream did not end within {timeout} s; last events: {describe(seen[-8:])}")


def describe(events: list) -> list[str]:
    return [
        f"{e.type}:{getattr(e, 'state', '') or getattr(e, 'code', '') or getattr(e, 'message', '')}" for e in events
    ]


def is_state(name: str):
    return lambda e: e.type == "state" and e.state == name


def states(events: list) -> list[str]:
    return [e.state for e in events if e.type == "state"]


def fatal_errors(events: list) -> list:
    return [e for e in events if e.type == "error" and e.fatal]


def wait_exit(worker: WorkerProcess, timeout: float = EXIT_TIMEOUT) -> int:
    assert worker.proc is not None
    try:
        return worker.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not exit within {timeout} s (see {worker.home}/worker.log)")


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running; a zombie (exited, not yet reaped by its new parent) counts as gone."""
    left = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc)
        except psutil.NoSuchProcess:
            pass
    return left


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(procs)


def names(procs: list[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        try:
            out.append(f"{proc.pid}:{proc.name()}")
        except psutil.Error:
            out.append(f"{proc.pid}:?")
    return out


def start_training(worker: WorkerProcess, command: Start) -> list:
    """Send ``start`` and wait for the first stats event after "training"; return the events."""
    assert worker.send(command)
    events = collect_until(worker, is_state("training"), START_TIMEOUT)
    assert not fatal_errors(events), describe(events)
    events += collect_until(worker, lambda e: e.type == "stats" and e.samples > 0, 30)
    return events


# ---- handshake and protocol ---------------------------------------------------------------------


def test_hello_then_idle_then_stop(spawn_worker):
    worker = spawn_worker()
    hello = next_event(worker)
    assert hello.type == "hello"
    assert hello.protocol == PROTOCOL_VERSION
    assert hello.pid == worker.pid
    assert worker.hello == hello
    idle = next_event(worker)
    assert (idle.type, idle.state) == ("state", "idle")

    assert worker.send(Stop())
    assert wait_exit(worker) == 0
    assert states(collect_to_end(worker, 5)) == ["stopped"]


def test_the_worker_takes_the_lowest_priority_before_it_imports_torch(spawn_worker, monkeypatch):
    """Right after Join the worker imports torch and hivemind, seconds of a core: at nice 19 and idle
    I/O priority already, so that they do not compete with what the user is doing."""
    monkeypatch.setenv("DEDLOC_WORKER_NICE", "19")
    worker = spawn_worker()
    assert next_event(worker).type == "hello"
    with open(f"/proc/{worker.pid}/maps") as maps:
        assert "libtorch" not in maps.read()  # it imports torch once told to start
    proc = psutil.Process(worker.pid)
    assert proc.nice() == 19
    assert proc.ionice().ioclass == psutil.IOPRIO_CLASS_IDLE


def test_stdin_eof_stops_an_idle_worker(spawn_worker):
    worker = spawn_worker()
    worker.proc.stdin.close()  # the app is gone
    assert wait_exit(worker) == 0
    assert states(collect_to_end(worker, 5)) == ["idle", "stopped"]


BAD_LINES = [
    ("this is not json", "protocol.not_json"),
    ('{"v":1,"type":"pause"', "protocol.not_json"),  # truncated
    ("[1, 2, 3]", "protocol.not_object"),
    ('"pause"', "protocol.not_object"),
    ('{"v":99,"type":"pause"}', "protocol.version"),
    ('{"type":"pause"}', "protocol.version"),
    ('{"v":"1","type":"pause"}', "protocol.version"),
    ('{"v":1,"type":"reboot"}', "protocol.invalid"),
    ('{"v":1}', "protocol.invalid"),
    ('{"v":1,"type":"pause","reason":"x","extra":1}', "protocol.invalid"),
    ('{"v":1,"type":"start"}', "protocol.invalid"),  # no experiment
    ('{"v":1,"type":"start","experiment":[]}', "protocol.invalid"),
    ('{"v":1,"type":"start","experiment":{},"batch_size":0}', "protocol.invalid"),
    ('{"v":1,"type":"start","experiment":{},"progress_period":-1}', "protocol.invalid"),
    ('{"v":1,"type":"set_limits","limits":{"cpu_threads":0}}', "protocol.invalid"),
]


def assert_quiet_and_alive(worker: WorkerProcess) -> None:
    time.sleep(0.3)
    extra = []
    while not worker.events.empty():
        extra.append(worker.events.get_nowait())
    assert not extra, describe(extra)
    assert worker.running()


def test_malformed_lines_are_errors_not_crashes(spawn_worker):
    worker = spawn_worker()
    collect_until(worker, is_state("idle"), 10)

    for line, code in BAD_LINES:
        assert worker.send_line(line)
        event = next_event(worker)
        assert event is not None and event.type == "error", (line, event)
        assert (event.code, event.fatal) == (code, False), line
        assert event.message

    # bytes that are not UTF-8
    worker.proc.stdin.buffer.write(b'{"v":1,"type":"\xff\xfe"}\n')
    worker.proc.stdin.flush()
    event = next_event(worker)
    assert (event.type, event.code, event.fatal) == ("error", "protocol.not_json", False)

    # An oversize line is one error, and none of it is obeyed: its tail (a valid stop, once the
    # head has been dropped) must not stop the worker. The next line (a JSON array) is its own.
    oversize = " " * (MAX_LINE + 300_000) + '{"v":1,"type":"stop"}'
    assert worker.send_line(oversize)
    assert worker.send_line("[0]")
    answers = [next_event(worker, 20), next_event(worker, 20)]
    assert describe(answers) == ["error:protocol.too_long", "error:protocol.not_object"]
    assert not answers[0].fatal
    assert_quiet_and_alive(worker)

    # One just over the limit that arrives whole.
    assert worker.send_line('{"v":1,"type":"pause","reason":"' + "x" * MAX_LINE + '"}')
    event = next_event(worker, 20)
    assert (event.type, event.code, event.fatal) == ("error", "protocol.too_long", False)

    # Still alive, still idle, and still obeys a valid command.
    assert_quiet_and_alive(worker)
    assert worker.send(Stop())
    assert wait_exit(worker) == 0
    assert states(collect_to_end(worker, 5)) == ["stopped"]


def test_log_records_become_log_events_whatever_the_level_is_called():
    """hivemind renames WARNING to "WARN" (logging.addLevelName); the worker's log forwarding must
    still send a valid ``log`` event, and never raise into the code that logged."""
    read, write = os.pipe()
    try:
        handler = EventLogHandler(EventChannel(write))
        record = logging.LogRecord("hivemind.dht.dht", logging.WARNING, __file__, 1, "grace %s", ("over",), None)
        record.levelname = "WARN"
        handler.handle(record)
        assert select.select([read], [], [], 5)[0], "no log event"
        event = decode_event(os.read(read, 65536))
    finally:
        os.close(read)
        os.close(write)
    assert (event.type, event.level, event.message) == ("log", "WARNING", "grace over")
    assert event.logger == "hivemind.dht.dht"


# ---- training -----------------------------------------------------------------------------------


def test_trains_pauses_within_a_second_resumes_and_stops_on_eof(spawn_worker, corpus_server):
    began = time.monotonic()
    worker = spawn_worker()
    # Report after every micro-batch, so the stats just before "paused" are the samples at the pause.
    command = replace(start_command(corpus_server, worker.home), progress_period=0.001)
    batch = command.experiment["batch_size_per_step"]
    events = start_training(worker, command)
    assert states(events)[:4] == ["idle", "preparing", "joining", "training"], describe(events)
    # Alone, it trains within seconds: no wait for peers that do not exist. Its log says where the
    # time went ("Ready to train 9.8 s after the process started (start 6.1 s, data 0.0 s, ...)").
    ready = [e.message for e in events if e.type == "log" and e.message.startswith("Ready to train")]
    training_at = time.monotonic() - began  # (the first stats came after "training": an upper bound)
    assert ready and training_at < LONE_TRAINING_S, f"{training_at:.1f} s: {ready}"
    training = [e for e in events if e.type == "state" and e.state == "training"][0]
    assert training.peer_id and training.maddrs

    # It trains: samples grow one micro-batch at a time, the loss is finite.
    events = collect_until(worker, lambda e: e.type == "stats" and e.samples >= 20 * batch, 60)
    samples = [e.samples for e in events if e.type == "stats"]
    assert len(samples) >= 5
    assert all(b > a for a, b in zip(samples, samples[1:], strict=False)), samples
    assert all(s % batch == 0 for s in samples)
    progress = [e for e in events if e.type == "progress"]
    assert progress and all(p.loss is not None and math.isfinite(p.loss) for p in progress)
    assert progress[-1].target_batch_size == command.experiment["target_batch_size"]
    assert progress[-1].samples_per_second > 0

    # Pause: "paused" within a second of sending it.
    sent = time.monotonic()
    assert worker.send(Pause(reason="user"))
    events = collect_until(worker, is_state("paused"), 10)
    latency = time.monotonic() - sent
    assert latency < 1.0, f"pause took {latency:.3f} s"
    assert events[-1].reason == "user"
    before = [e for e in events if e.type == "stats"]
    at_pause = before[-1].samples if before else samples[-1]

    # Paused for 2 s: nothing trains, nothing is reported.
    time.sleep(2.0)
    quiet = []
    while not worker.events.empty():
        quiet.append(worker.events.get_nowait())
    assert not [e for e in quiet if e.type in ("stats", "progress", "state")], describe(quiet)
    assert worker.running()

    # Resume: "training" again; the first report after it counts exactly one more micro-batch
    # (had training gone on while paused, 2 s would have added dozens), then samples grow again.
    assert worker.send(Resume())
    collect_until(worker, is_state("training"), 5)
    first = collect_until(worker, lambda e: e.type == "stats", 10)[-1]
    assert first.samples - at_pause == batch, (at_pause, first.samples)
    assert first.paused_seconds >= 2.0
    later = collect_until(worker, lambda e: e.type == "stats" and e.samples >= first.samples + 5 * batch, 30)[-1]
    assert later.compute_seconds > first.compute_seconds
    assert later.paused_seconds == first.paused_seconds

    # EOF on stdin (the app went away) stops it cleanly.
    worker.proc.stdin.close()
    assert wait_exit(worker) == 0
    tail = collect_to_end(worker, 5)
    assert states(tail)[-2:] == ["stopping", "stopped"]
    assert not [e for e in tail if e.type == "error"], describe(tail)


def _descendants_while_training(worker: WorkerProcess, corpus_server) -> list[psutil.Process]:
    command = start_command(corpus_server, worker.home)
    start_training(worker, command)
    # Progress every progress_period (0.5 s) and at each new global step, not after every
    # micro-batch (it was: a tuple compared with an int, 10-20 reports a second).
    began = time.monotonic()
    events = collect_until(worker, lambda e: time.monotonic() - began >= 3.0, 30)
    samples = [e.samples for e in events if e.type == "stats"]
    batches = (samples[-1] - samples[0]) // command.experiment["batch_size_per_step"] if samples else 0
    progress = [e for e in events if e.type == "progress"]
    epochs = len({p.local_epoch for p in progress})  # a new global step reports at once, too
    assert len(progress) <= 3.0 / command.progress_period + epochs + 2, \
        f"{len(progress)} progress events in 3 s ({batches} micro-batches, {epochs} global steps)"
    children = psutil.Process(worker.pid).children(recursive=True)
    found = [n.split(":", 1)[1] for n in names(children)]
    assert "p2pd" in found, found
    p2pd = next(c for c in children if c.name() == "p2pd")
    # a volunteer's p2pd runs Go on one thread (swarm.p2pd_on_one_thread)
    assert p2pd.environ().get("GOMAXPROCS") == os.environ.get("GOMAXPROCS", "1"), p2pd.environ()
    # the DHT and the two averagers (hivemind_ext/helper_threads.py can make them threads; off by default)
    assert found.count("python") + found.count("python3") == 3, found
    return children


def test_a_pause_before_joining_holds_the_worker_out_of_the_swarm(spawn_worker, corpus_server):
    """Paused while it starts (the app's freeze missed it, or none was asked): once its imports are
    done the worker waits, using no CPU, and joins only on resume."""
    worker = spawn_worker()
    assert worker.send(start_command(corpus_server, worker.home))
    assert worker.send(Pause(reason="user"))
    events = collect_until(worker, lambda e: e.type == "state" and e.state in ("paused", "joining", "training"),
                           START_TIMEOUT)
    assert events[-1].state == "paused" and events[-1].reason == "user", describe(events)
    proc = psutil.Process(worker.pid)
    used = sum(proc.cpu_times()[:2])
    joined = worker.wait_for(lambda e: e.type == "state" and e.state in ("joining", "training"), 3)
    assert joined is None, "it joined while paused"
    assert sum(proc.cpu_times()[:2]) - used < 0.3  # 3 s of waiting
    assert worker.send(Resume())
    events = collect_until(worker, is_state("training"), START_TIMEOUT)
    assert "joining" in states(events), describe(events)


def test_stop_exits_zero_and_leaves_no_process_or_shared_memory(spawn_worker, corpus_server):
    worker = spawn_worker()
    children = _descendants_while_training(worker, corpus_server)
    # hivemind's shared tensors are file descriptors (no torch_shm_manager, nothing in /dev/shm)
    held = []
    for fd in os.listdir(f"/proc/{worker.pid}/fd"):
        try:
            held.append(os.readlink(f"/proc/{worker.pid}/fd/{fd}"))
        except OSError:
            continue
    unlinked = [link for link in held if link.startswith("/dev/shm/torch_") and link.endswith("(deleted)")]
    assert unlinked, f"expected hivemind's shared tensors as descriptors of unlinked segments: {sorted(held)}"
    assert not glob.glob(f"/dev/shm/torch_{worker.pid}_*"), "shared-memory segments left in /dev/shm"

    assert worker.send(Stop())
    began = time.monotonic()
    code = wait_exit(worker)
    took = time.monotonic() - began
    assert code == 0, f"exit code {code} after stop (see {worker.home}/worker.log)"
    tail = collect_to_end(worker, 5)
    assert states(tail)[-2:] == ["stopping", "stopped"], describe(tail)
    assert not fatal_errors(tail)
    # The worker itself ended p2pd (nothing has reaped its group yet)
    left = wait_gone(children, 2)
    assert not left, f"left behind: {names(left)}"
    assert worker.stop() is StopResult.NOT_RUNNING
    assert not glob.glob(f"/dev/shm/torch_{worker.pid}_*"), "shared-memory segments left in /dev/shm"
    print(f"stop -> exit in {took:.1f} s")


def test_sigkill_of_the_worker_alone_takes_its_children(spawn_worker, corpus_server):
    worker = spawn_worker()
    children = _descendants_while_training(worker, corpus_server)

    os.kill(worker.pid, signal.SIGKILL)  # the worker only, not its process group
    assert wait_exit(worker) == -signal.SIGKILL
    left = wait_gone(children, 10)
    assert not left, f"survived the worker: {names(left)}"


# ---- fatal errors -------------------------------------------------------------------------------


def test_corrupt_shard_is_a_fatal_error_exit_3(spawn_worker):
    shard = CORPUS_MANIFEST["shards"][0]
    good = resources.files("resources").joinpath("corpus", shard["name"]).read_bytes()
    assert hashlib.sha256(good).hexdigest() == shard["sha256"]
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF  # same size, one byte off
    path = f"/data/{shard['name']}"
    with FileServer({path: bytes(bad)}) as server:
        worker = spawn_worker()
        assert worker.send(start_command(server, worker.home))
        code = wait_exit(worker, 60)
        events = collect_to_end(worker, 5)
        assert code == 3, describe(events)
        errors = fatal_errors(events)
        assert len(errors) == 1 and errors[0].code == "corrupt", describe(events)
        assert shard["name"] in errors[0].message
        assert "training" not in states(events) and "joining" not in states(events)
        assert server.count(path, "GET") >= 2  # a mismatching shard is discarded and fetched again
    cached = worker.home / "cache" / "shards"
    assert not [p for p in cached.iterdir() if p.name.startswith(shard["sha256"])], list(cached.iterdir())


def test_an_entry_point_whose_dht_does_not_answer_is_reported_by_name_exit_3(spawn_worker, corpus_server):
    """Initial peers that p2pd reaches but whose DHT answers no ping (a backbone gone, a volunteer
    that only uses the DHT): the worker says the swarm is unreachable, not "crashed"."""
    import hivemind

    entry = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True, start=True)
    try:
        worker = spawn_worker("lost")
        maddrs = [str(m) for m in entry.get_visible_maddrs()]
        assert worker.send(start_command(corpus_server, worker.home, initial_peers=maddrs))
        code = wait_exit(worker, START_TIMEOUT)
        events = collect_to_end(worker, 5)
    finally:
        entry.shutdown()
    assert code == 3, describe(events)
    errors = fatal_errors(events)
    assert len(errors) == 1 and errors[0].code == "swarm_unreachable", describe(events)
    assert maddrs[0] in errors[0].message


def test_a_second_worker_with_the_same_identity_is_refused_by_name_exit_3(spawn_worker, corpus_server):
    """Two workers with one peer identity (a data folder copied to another computer): the second is
    told why and what to do, not handed a P2PDaemonError traceback."""
    first = spawn_worker("first")
    assert first.send(start_command(corpus_server, first.home))
    training = first.wait_for(lambda e: getattr(e, "state", None) == "training", START_TIMEOUT)
    assert training is not None, "the first worker did not start"
    second = spawn_worker("second")
    assert second.send(start_command(corpus_server, first.home, initial_peers=training.maddrs))
    code = wait_exit(second, START_TIMEOUT)
    events = collect_to_end(second, 5)
    assert code == 3, describe(events)
    errors = fatal_errors(events)
    assert len(errors) == 1 and errors[0].code == "identity_taken", describe(events)
    assert str(first.home / "identity.key") in errors[0].hint
    assert first.running()  # the first one trains on


@pytest.mark.parametrize(
    "experiment",
    [
        pytest.param(tiny_experiment(recipe="no-such-recipe"), id="unknown-recipe"),
        pytest.param(tiny_experiment(recipe_params={"d_model": -5}), id="bad-params"),
        pytest.param({"id": "x"}, id="incomplete"),
    ],
)
def test_invalid_experiment_is_a_fatal_error_exit_3(spawn_worker, corpus_server, experiment):
    worker = spawn_worker()
    command = replace(start_command(corpus_server, worker.home), experiment=experiment)
    assert worker.send(command)
    code = wait_exit(worker, 60)
    events = collect_to_end(worker, 5)
    assert code == 3, describe(events)
    errors = fatal_errors(events)
    assert len(errors) == 1 and errors[0].code == "bad_experiment", describe(events)
    assert errors[0].message
    assert states(events) == ["idle"], describe(events)  # never got as far as preparing
