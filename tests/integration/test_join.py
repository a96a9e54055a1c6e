"""Ranks that join a listening controller (``python -m monarch_worker``), on this host: under torchrun, started
by hand, and against a fake controller. Real processes, real sockets, real gloo. The same over network
namespaces and SLURM is in tests/multihost."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from monarch_jupyter import Mesh, MeshError, MeshNotRunningError, MeshStartError, RankDiedError, RemoteError
from monarch_jupyter.errors import MeshInterrupt
from monarch_jupyter.kernel import registry
from monarch_worker import protocol as P
from tests.conftest import magic_shell, reap, wait_gone

pytestmark = pytest.mark.slow


def run(mesh: Mesh, code: str, **kw: object) -> object:
    return mesh.run(textwrap.dedent(code), **kw)


@pytest.fixture(scope="module")
def joined() -> Iterator[Mesh]:
    """Two ranks started by torchrun's elastic agent on this host."""
    m = Mesh(2, launcher="torchrun", start_timeout=120)
    yield m
    m.stop()


def start_ranks(mesh: Mesh, n: int, extra: dict[str, str] | None = None, **kw: object) -> list[subprocess.Popen]:
    """Run the printed generic command ``n`` times (what a user pastes on other hosts)."""
    env = {**os.environ, **mesh.join_commands().env, **(extra or {})}
    return [subprocess.Popen([sys.executable, "-m", "monarch_worker"], env=env, **kw) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- torchrun ranks


def test_torchrun_numbers_the_ranks_and_owns_the_rendezvous(joined: Mesh) -> None:
    env = run(joined, """
        import os
        {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                        "TORCHELASTIC_RUN_ID", "MONARCH_SECRET")}
    """)
    for r in (0, 1):
        e = env[r]
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (str(r), str(r), "2", "2")
        assert e["TORCHELASTIC_RUN_ID"]  # started by torchrun's agent
        assert e["MONARCH_SECRET"] is None  # read once, then dropped from the environment user code sees
    assert run(joined, "t = torch.ones(2) * (rank + 1); dist.all_reduce(t); t.tolist()") == {0: [3.0, 3.0],
                                                                                          1: [3.0, 3.0]}
    assert joined.hosts() == {socket.gethostname(): [0, 1]}
    placement = joined.listener.placement()
    assert placement[1]["local_rank"] == 1 and "TORCHELASTIC_RUN_ID" in placement[1]["launcher_env"]


def test_output_results_and_errors_as_for_local_ranks(joined: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    out = run(joined, """
        import os, sys, ctypes
        os.write(1, b"fd-level\\n")
        ctypes.CDLL(None).write(2, b"from C on stderr\\n", 17)
        print("python stdout", rank)
        print("to stderr", file=sys.stderr)
        sys.stdout.write("no newline at the end")
        rank * 10
    """, order="rank")
    assert out == {0: 0, 1: 10}
    cap = capsys.readouterr()
    for r in (0, 1):
        assert f"[rank{r}]: fd-level" in cap.out and f"[rank{r}]: python stdout {r}" in cap.out
        assert f"[rank{r}]: no newline at the end" in cap.out
        assert f"[rank{r}]: from C on stderr" in cap.err and f"[rank{r}]: to stderr" in cap.err
    assert cap.out.index("[rank0]: python stdout") < cap.out.index("[rank1]: fd-level")  # --order rank
    assert "monarch-sync" not in cap.out + cap.err
    with pytest.raises(MeshError) as info:
        run(joined, """
            x = 1
            if rank == 1:
                raise ValueError(f"bad value on {rank}")
            x
        """)
    err = info.value.errors[1]
    assert isinstance(err, RemoteError) and err.ename == "ValueError" and "bad value on 1" in err.evalue
    assert 'raise ValueError(f"bad value on {rank}")' in err.traceback  # the cell's own line, from the rank
    assert info.value.results == {0: 1}


def test_stacks_and_interrupt(joined: Mesh) -> None:
    handle = run(joined, "import time\nif rank == 1:\n    time.sleep(30)\n", block=False)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        report = joined.stacks()
        if any(rs == [1] and key and key[0] != "idle" and "sleep" in str(key) for rs, key in report.groups()):
            break
        time.sleep(0.1)
    assert "rank 1:" in report.text and "line 3" in report.text, report.text
    with pytest.raises(KeyboardInterrupt):
        joined.waiter.interrupt_cell(handle.record)
        handle.result(timeout=10)
    assert run(joined, "rank", ranks=1) == {1: 1}


def test_secret_is_on_no_command_line(joined: Mesh) -> None:
    secret = joined.state.secret.hex().encode()
    seen = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            assert secret not in cmd, f"the secret is on the command line of pid {entry}"
            seen += b"monarch_worker" in cmd
    assert seen >= 3  # the torchrun agent and both ranks were looked at
    assert secret.decode() not in str(joined.listener.commands)


# ---------------------------------------------------------------------------------------------- %mesh listen


def test_listen_reports_who_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    shell = magic_shell()
    saved = registry.peek_current()
    registry.set_current(None)
    try:
        shell.run_line_magic("mesh", "listen --world-size 3 --timeout 300")
        m = registry.peek_current()
        joined: list[int] = []
        m.add_listener(lambda kind, data: joined.append(data["joined"]) if kind == "rank_joined" else None)
        printed = capsys.readouterr().out
        assert "torchrun --nnodes 1 --nproc-per-node 3 --standalone" in printed and "srun " in printed
        assert m.state.secret.hex() not in printed
        key = Path(m.join_commands().secret_file)
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        procs = start_ranks(m, 1, {"RANK": "0", "WORLD_SIZE": "3"}, stderr=subprocess.PIPE)
        procs += start_ranks(m, 1, stderr=subprocess.PIPE)  # no launcher: numbered once all joined
        deadline = time.monotonic() + 240  # fresh interpreters import torch: a minute on a loaded machine
        while max(joined, default=0) < 2 and time.monotonic() < deadline:  # wait for both, not for a time
            time.sleep(0.05)
        assert max(joined, default=0) == 2, joined
        assert m.status()[0]["host"] == socket.gethostname()  # %mesh status shows who is there while waiting
        m.listener.deadline = time.monotonic()  # the start timeout is over now
        with pytest.raises(MeshStartError) as info:
            shell.run_cell_magic("mesh", "", "rank")  # waits for the ranks, then reports
        text = str(info.value)
        assert "2 of 3 ranks joined within 300 s" in text and f"{socket.gethostname()}: rank(s) 0, ?" in text
        assert "missing: 1 rank(s)" in text
        codes = reap(procs)
        assert codes == [2, 2]  # told to go (Rejected), not left waiting
        assert "not admitted to the mesh" in procs[0].stderr.read().decode()
        assert not key.exists() and not m.running and not m.listening
    finally:
        registry.set_current(saved)


def test_listen_timeout_with_nobody_waiting_reports_and_releases(capsys: pytest.CaptureFixture[str]) -> None:
    shell = magic_shell()
    saved = registry.peek_current()
    registry.set_current(None)
    try:
        shell.run_line_magic("mesh", "listen -n 2 --timeout 1")
        first = registry.peek_current()
        deadline = time.monotonic() + 15
        while not first.start_failure and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "0 of 2 ranks joined within 1 s" in first.start_failure and not first.listening
        assert "mesh: 0 of 2 ranks joined" in capsys.readouterr().err  # said in the listen cell's output
        shell.run_line_magic("mesh", "listen -n 2 --timeout 60")  # the failed one is released, not in the way
        second = registry.peek_current()
        assert second is not first and second.listening and not first.listener.is_open
        second.stop()
        assert not second.listening
    finally:
        registry.set_current(saved)


def test_a_listening_mesh_can_be_stopped_interrupted_and_asked_without_waiting_for_the_join(
        capsys: pytest.CaptureFixture[str]) -> None:
    """helper-49: ``%mesh stop`` said "already stopped" to a mesh still waiting for its ranks (and ``%mesh start``
    then refused: "a mesh is already running"); ``%mesh interrupt`` waited for the join and raised its timeout as
    its own error; an interrupted ``%%mesh`` cell waiting for the join showed the controller's frames."""
    shell = magic_shell()
    saved = registry.peek_current()
    registry.set_current(None)
    try:
        shell.run_line_magic("mesh", "listen --world-size 2 --timeout 600")
        m = registry.peek_current()
        for sub in ("interrupt", "stacks"):  # nothing to wait for: refused at once, the mesh listens on
            with pytest.raises(MeshNotRunningError, match="0 of 2 joined so far and the mesh still listens"):
                shell.run_line_magic("mesh", sub)
            assert m.listening
        main = threading.main_thread().ident
        assert main is not None

        def interrupt_once_waiting() -> None:
            deadline = time.monotonic() + 60
            while not m.listener.waiting and time.monotonic() < deadline:
                time.sleep(0.01)
            signal.pthread_kill(main, signal.SIGINT)  # the notebook's interrupt, once the cell waits for the join

        threading.Thread(target=interrupt_once_waiting, daemon=True).start()
        with pytest.raises(MeshInterrupt) as info:
            shell.run_cell_magic("mesh", "--no-widget", "rank")
        assert "interrupted while waiting for the ranks to join: 0 of 2 joined" in str(info.value)
        assert info.value.__suppress_context__ and m.listening  # one line; the mesh still listens
        capsys.readouterr()
        shell.run_line_magic("mesh", "stop")
        assert "stopped the mesh, which was waiting for its ranks" in capsys.readouterr().out
        assert not m.listening and not m.listener.is_open and registry.peek_current() is None
        shell.run_line_magic("mesh", "listen --world-size 1 --timeout 600")  # nothing in the way now
        again = registry.peek_current()
        assert again is not m and again.listening
        again.stop()
    finally:
        registry.set_current(saved)


def test_listen_encrypted_numbers_ranks_rejects_mismatches() -> None:
    m = Mesh.listen(2, encrypt=True, timeout=120, show=False)
    procs: list[subprocess.Popen] = []
    try:
        commands = m.join_commands()
        assert commands.curve_serverkey and "MONARCH_CURVE_SERVERKEY" in commands.generic
        # the right secret over plain TCP: a CURVE server does not even complete the handshake
        ctx = zmq.Context()
        try:
            plain = ctx.socket(zmq.DEALER)
            plain.setsockopt(zmq.LINGER, 0)
            plain.connect(m.address)
            try:  # NOBLOCK: once the failed handshake has dropped the connection, a send would wait forever
                plain.send_multipart(P.Signer(m.state.secret).pack(P.Hello(rank=0, pid=1, host="plain")),
                                     flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            assert plain.poll(500) == 0
        finally:
            ctx.destroy(0)
        wrong = start_ranks(m, 1, {"RANK": "0", "WORLD_SIZE": "5"}, stderr=subprocess.PIPE)
        assert reap(wrong, 60) == [2]
        assert "launched with world size 5, but the mesh listens for 2" in wrong[0].stderr.read().decode()
        assert m.listener.joined_count() == 0
        procs = start_ranks(m, 2, stdout=subprocess.PIPE)
        assert m.wait_ready(120)
        assert run(m, "print('tee', rank); (rank, local_rank, world_size)") == {0: (0, 0, 2), 1: (1, 1, 2)}
        assert m.hosts() == {socket.gethostname(): [0, 1]}
    finally:
        m.stop()
    assert reap(procs) == [0, 0]  # graceful: Shutdown, Goodbye, exit 0
    tee = b"".join(p.stdout.read() for p in procs)
    assert b"tee 0" in tee and b"tee 1" in tee  # the launcher's terminal sees the output too ...
    assert P.SYNC_PREFIX not in tee  # ... without the sync markers


def test_listening_controller_survives_strangers(tmp_path: Path) -> None:
    m = Mesh.listen(1, timeout=60, show=False)
    marker = tmp_path / "unpickled"

    class Bomb:
        def __reduce__(self) -> tuple:
            return (Path.touch, (marker,))

    secret = bytes.fromhex(Path(m.join_commands().secret_file).read_text().strip())
    ctx = zmq.Context()
    try:
        port = int(m.address.rsplit(":", 1)[1])
        evil = ctx.socket(zmq.DEALER)
        evil.setsockopt(zmq.LINGER, 0)
        evil.connect(m.address)
        evil.send_multipart(P.Signer(b"w" * 32).pack(P.Hello(rank=0, pid=1, host="evil", world_size=1)))
        evil.send_multipart(P.Signer(b"w" * 32).pack(P.Result(1, "ok", has_value=True), pickle.dumps(Bomb())))
        evil.send_multipart([P.MAGIC, b"", b'{"t": "hello"}', pickle.dumps(Bomb())])  # unsigned
        evil.send(os.urandom(1000))
        raw = socket.create_connection(("127.0.0.1", port))
        raw.sendall(os.urandom(4096))
        raw.close()
        assert evil.poll(500) == 0  # nothing comes back to a peer without the secret
        io_thread = m.parts.io.thread
        assert m.listener.joined_count() == 0 and not marker.exists() and io_thread is not None and io_thread.is_alive()
        good = ctx.socket(zmq.DEALER)
        good.setsockopt(zmq.LINGER, 0)
        good.connect(m.address)
        rank_signer = P.Signer(secret)
        good.send_multipart(rank_signer.pack(P.Hello(rank=0, pid=2, host="good", world_size=1)))
        assert good.poll(5000), "a peer with the secret gets an answer"
        welcome, _, _ = P.Signer(secret).unpack(good.recv_multipart())  # signed with the mesh secret
        assert isinstance(welcome, P.Welcome) and welcome.rank == 0
    finally:
        ctx.destroy(0)
        m.stop()


def test_rank_acts_only_on_messages_signed_with_the_secret(tmp_path: Path) -> None:
    """A fake controller: the rank ignores a forged Welcome and Exec, acts on signed ones, rejects replays."""
    secret = os.urandom(32)
    marker = tmp_path / "ran"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    env = {**os.environ, "MONARCH_CONTROLLER": f"tcp://127.0.0.1:{port}", "MONARCH_SECRET": secret.hex(),
           "RANK": "0", "WORLD_SIZE": "1", "MONARCH_JOIN_TIMEOUT": "60"}
    proc = subprocess.Popen([sys.executable, "-m", "monarch_worker"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    ours, forger = P.Signer(secret), P.Signer(os.urandom(32))
    verify = P.Signer(secret)

    def receive(seconds: float, until: type | None = None) -> list[P.Message]:
        """What the rank sent within ``seconds`` (or until a message of type ``until``)."""
        got: list[P.Message] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if router.poll(50):
                frames = router.recv_multipart()
                got.append(verify.unpack(frames[1:])[0])
                if until is not None and isinstance(got[-1], until):
                    break
        return got

    def send(signer: P.Signer, msg: P.Message) -> list:
        frames = [ident, *signer.pack(msg)]
        router.send_multipart(frames)
        return frames

    try:
        assert router.poll(30000)
        ident, *rest = router.recv_multipart()
        hello = verify.unpack(rest)[0]
        assert isinstance(hello, P.Hello) and hello.rank == 0
        welcome = P.Welcome(0, 1, 0, 1, "127.0.0.1", 0)
        send(forger, welcome)
        router.send_multipart([ident, P.MAGIC, b"", *P.Signer(secret).pack(welcome)[2:]])  # unsigned
        assert not any(isinstance(m, (P.StoreReady, P.Ready)) for m in receive(2.0))
        send(ours, welcome)
        got = receive(60, until=P.Ready)
        assert any(isinstance(m, P.StoreReady) for m in got) and any(isinstance(m, P.Ready) for m in got)
        code = f"open({str(marker)!r}, 'a').write('x')"
        send(forger, P.Exec(1, code, "<forged>"))
        assert not any(isinstance(m, P.Result) for m in receive(1.5)) and not marker.exists()
        frames = send(ours, P.Exec(2, code, "<cell>"))
        results = [m for m in receive(10.0, until=P.Result) if isinstance(m, P.Result)]
        assert [r.cell_id for r in results] == [2] and marker.read_text() == "x"
        router.send_multipart(frames)  # a replay of a signed message
        assert not any(isinstance(m, P.Result) for m in receive(1.5)) and marker.read_text() == "x"
        send(ours, P.Shutdown())
        assert any(isinstance(m, P.Goodbye) and m.returncode == 0 for m in receive(10.0, until=P.Goodbye))
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.destroy(0)


# ---------------------------------------------------------------------------------------------- deaths


def test_heartbeat_loss_marks_a_joined_rank_dead() -> None:
    m = Mesh.listen(1, timeout=120, heartbeat_timeout=3, heartbeat_interval=0.5, show=False)
    procs = start_ranks(m, 1)
    try:
        assert run(m, "rank") == {0: 0}
        handle = run(m, "import time; time.sleep(60)", block=False)
        os.kill(procs[0].pid, signal.SIGSTOP)  # alive but silent, like a host that vanished
        with pytest.raises(MeshError) as info:
            handle.result(timeout=30)
        err = info.value.errors[0]
        assert isinstance(err, RankDiedError) and "lost (no heartbeat for 3 s" in str(err)
        assert procs[0].wait(10) == -signal.SIGKILL  # on this host the controller also kills it
        assert m.status()[0]["state"] == "dead"
    finally:
        m.stop()
        reap(procs)


def test_killed_torchrun_agent_takes_its_ranks_and_fails_the_cell() -> None:
    m = Mesh(1, launcher="torchrun", start_timeout=120)
    try:
        pid = m.status()[0]["pid"]
        handle = run(m, "import time; time.sleep(60)", block=False)
        os.killpg(m.state.launcher.proc.pid, signal.SIGKILL)  # the agent only (ranks have their own session)
        with pytest.raises(MeshError) as info:
            handle.result(timeout=30)
        assert isinstance(info.value.errors[0], RankDiedError)
        assert not wait_gone({pid}, timeout=10)
    finally:
        m.stop()


def test_start_options_that_do_not_fit_are_usage_errors() -> None:
    from IPython.core.error import UsageError
    shell = magic_shell()
    saved = registry.peek_current()
    registry.set_current(None)
    try:
        for line, match in [
            ("start --launcher slurm -n 2", "give --address"),
            ("start -n 2 --address eth0", "are for --launcher torchrun, agent or slurm"),
            ("start --launcher agent -n 2 --nnodes 2", "one host agent on this host"),
            ("start --launcher torchrun --nnodes 2 --nproc-per-node 2", "--nnodes 1"),
            ("start --launcher torchrun -n 3 --address no-such-nic0", "neither an interface"),
            ("start --launcher agent -n 3 --nproc-per-node 2", "leave --nproc-per-node out"),
            ("start --launcher agent -n 100000", "--force"),  # this host's room, as for local ranks
            ("start --launcher agent --nproc-per-node 0", "--nproc-per-node must be at least 1"),
            ("start --launcher torchrun --nproc-per-node -2", "--nproc-per-node must be at least 1"),
            ("listen --world-size 0", "nproc must be a positive"),
            ("listen", "required"),
        ]:
            with pytest.raises(UsageError, match=match):
                shell.run_line_magic("mesh", line)
        assert registry.peek_current() is None  # nothing started
    finally:
        registry.set_current(saved)


def test_secret_file_removed_when_the_kernel_exits_without_stop() -> None:
    code = ("from monarch_jupyter import Mesh\n"
            "m = Mesh.listen(2, show=False)\n"
            "print(m.join_commands().secret_file, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    path = Path(out.stdout.strip())
    assert path.name.startswith("monarch-mesh-") and not path.exists()
