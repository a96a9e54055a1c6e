"""The Mesh through its Python API, on real processes with a real gloo process group."""

from __future__ import annotations

import os
import socket
import textwrap

import pytest

from monarch_jupyter import Mesh, MeshError, MeshNotRunningError, MeshStartError, RankMap, RemoteError
from tests.conftest import wait_gone, worker_pids


def run(mesh: Mesh, code: str, **kw: object) -> object:
    return mesh.run(textwrap.dedent(code), **kw)


def test_all_reduce_and_namespace(mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    out = run(mesh, """
        t = torch.ones(3) * rank
        dist.all_reduce(t)
        print(rank, t.tolist())
        t.sum().item()
    """)
    assert out == dict.fromkeys(range(4), 18.0)
    assert isinstance(out, RankMap)
    printed = capsys.readouterr().out.splitlines()
    assert sorted(printed) == [f"[rank{r}]: {r} [6.0, 6.0, 6.0]" for r in range(4)]
    names = run(mesh, "(rank, world_size, local_rank, str(device), dist.get_backend(), dist.get_world_size())")
    assert names == {r: (r, 4, r, "cpu", "gloo", 4) for r in range(4)}


def test_torchrun_environment(mesh: Mesh) -> None:
    env = run(mesh, """
        import os
        {k: os.environ[k]
         for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    """)
    ports = {e["MASTER_PORT"] for e in env.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for r, e in env.items():
        assert (e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == (str(r), "4", str(r), "4")
        assert e["MASTER_ADDR"] == "127.0.0.1"


def test_state_persists_and_subsets(mesh: Mesh) -> None:
    run(mesh, "counter = rank * 10")
    run(mesh, "counter += 1", ranks="1-2")
    assert run(mesh, "counter") == {0: 0, 1: 11, 2: 21, 3: 30}
    assert run(mesh, "counter", ranks="::2") == {0: 0, 2: 21}
    assert run(mesh, "counter", ranks=3) == {3: 30}


def test_no_value_returns_none_and_none_values_are_kept(mesh: Mesh) -> None:
    assert run(mesh, "y = 1") is None
    assert run(mesh, "None") is None
    assert run(mesh, "rank if rank == 1 else None") == {0: None, 1: 1, 2: None, 3: None}


def test_output_at_fd_level_and_last_line_without_newline(mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    run(mesh, """
        import os, sys, ctypes
        os.write(1, b"fd-level\\n")
        ctypes.CDLL(None).write(2, b"from C on stderr\\n", 17)
        print("python stdout")
        print("to stderr", file=sys.stderr)
        sys.stdout.write("no newline at the end")
    """, ranks="0,3")
    cap = capsys.readouterr()
    for r in (0, 3):
        assert f"[rank{r}]: fd-level" in cap.out
        assert f"[rank{r}]: python stdout" in cap.out
        assert f"[rank{r}]: no newline at the end" in cap.out
        assert f"[rank{r}]: from C on stderr" in cap.err
        assert f"[rank{r}]: to stderr" in cap.err
    assert "[rank1]" not in cap.out + cap.err


def test_rank_order_output_is_deterministic(mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    run(mesh, """
        import time
        time.sleep(0.05 * (3 - rank))
        for i in range(3):
            print(f"line {i}")
    """, order="rank")
    out = capsys.readouterr().out.splitlines()
    assert out == [f"[rank{r}]: line {i}" for r in range(4) for i in range(3)]


def test_exception_on_some_ranks(mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    code = textwrap.dedent("""
        print("before", rank)
        def inner(x):
            return 1 / x
        inner(0) if rank in (1, 2) else rank * 2
    """)
    with pytest.raises(MeshError) as info:
        mesh.run(code)
    err = info.value
    assert sorted(err.errors) == [1, 2]
    assert err.results == {0: 0, 3: 6}
    assert isinstance(err.root_cause, RemoteError)
    assert err.root_cause.ename == "ZeroDivisionError"
    text = "\n".join(err._render_traceback_())
    assert "root cause: rank" in text
    assert "return 1 / x" in text and "inner(0)" in text  # the cell's own lines
    assert "<string>" not in text and "runtime.py" not in text
    out = capsys.readouterr().out
    assert all(f"[rank{r}]: before {r}" in out for r in range(4))
    assert run(mesh, "rank") == {r: r for r in range(4)}  # the mesh stays usable
    handle = mesh.run("1 / 0 if rank in (1, 2) else rank", block=False)  # its handle says it failed, and where
    assert handle.wait(60)
    assert repr(handle).endswith(": failed on ranks 1,2>"), repr(handle)
    assert repr(mesh.run("rank", block=False)).endswith((": running>", ": done>"))


def test_syntax_error_reported_once_before_anything_runs(mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SyntaxError) as info:
        mesh.run("print('ran')\nx = (1,\n")
    assert capsys.readouterr().out == ""
    assert info.value.lineno is not None


def test_unpicklable_result_names_its_type(mesh: Mesh) -> None:
    with pytest.raises(MeshError) as info:
        run(mesh, """
            import threading
            threading.Lock() if rank == 0 else rank
        """)
    err = info.value
    assert list(err.errors) == [0]
    assert "lock" in err.errors[0].evalue.lower()
    assert err.results == {1: 1, 2: 2, 3: 3}


class Scaler:
    def __init__(self, k: int) -> None:
        self.k = k

    def apply(self, x: int) -> int:
        return self.k * x


def test_call_with_local_function_and_class(mesh: Mesh) -> None:
    def f(x: int, scale: Scaler) -> int:
        import torch.distributed as dist

        return scale.apply(x + dist.get_rank())

    assert mesh.call(f, 1, Scaler(3), ranks="0-1") == {0: 3, 1: 6}


def test_stop_leaves_no_process_and_restart_is_fresh() -> None:
    m = Mesh(2)
    pids = {s["pid"] for s in m.status().values()}
    assert len(pids) == 2 and pids <= worker_pids()
    m.run("secret = 42")
    m.restart()
    with pytest.raises(MeshError) as info:
        m.run("secret")
    assert all(e.ename == "NameError" for e in info.value.errors.values())
    new_pids = {s["pid"] for s in m.status().values()}
    assert not (new_pids & pids)
    assert not wait_gone(pids, timeout=5)
    assert m.run("dist.get_world_size()") == {0: 2, 1: 2}
    m.stop()
    assert not wait_gone(new_pids, timeout=5)
    with pytest.raises(MeshNotRunningError, match="start"):
        m.run("1")


def test_start_when_port_29500_is_taken() -> None:
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", 29500))
            s.listen()
        except OSError:
            pass  # already taken by someone else: the point holds
        with Mesh(2) as m:
            assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}
    finally:
        s.close()


def test_rank_that_fails_to_join_fails_start_with_its_error() -> None:
    before = worker_pids()
    with pytest.raises(MeshStartError) as info:
        Mesh(2, env={"GLOO_SOCKET_IFNAME": "no-such-nic0"}, start_timeout=60)
    text = str(info.value)
    assert "rank" in text and "no-such-nic0" in text
    assert not wait_gone(worker_pids() - before - _fork_servers(), timeout=5)


def _fork_servers() -> set[int]:
    """The shared fork server stays up between meshes; it is not a rank."""
    from monarch_jupyter.kernel.launch.local import fork_server_pid

    pid = fork_server_pid()
    return {pid} if pid is not None else set()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="nproc"):
        Mesh(0)
    with pytest.raises(ValueError, match="backend"):
        Mesh(2, backend="mpi")
    with pytest.raises(MeshStartError, match="GPU"):
        Mesh(2, backend="nccl")


def test_bad_rank_selection_keeps_mesh(mesh: Mesh) -> None:
    with pytest.raises(ValueError, match="world size 4"):
        mesh.run("1", ranks="7")
    assert mesh.run("rank", ranks="0") == {0: 0}


def test_bad_arguments_of_run_and_call_are_refused_before_anything_runs(mesh: Mesh) -> None:
    mesh.run("hits = 0")
    bump = "hits += 1\nhits"
    refused: list[tuple[type, str, dict]] = [
        (TypeError, "a rank is an int, got 1.5", {"ranks": 1.5}),
        (TypeError, "a rank is an int, got True", {"ranks": True}),  # was read as rank 1
        (ValueError, "cannot parse rank selection ''", {"ranks": ""}),  # was every rank, while [] was refused
        (ValueError, "part ''", {"ranks": "0,,1"}),
        (ValueError, "selects no rank", {"ranks": []}),
        (ValueError, "above 0 seconds", {"timeout": 0}),  # interrupted the cell at once
        (ValueError, "above 0 seconds", {"timeout": -1}),
        (TypeError, "a number of seconds", {"timeout": "5"})]
    for error, words, kwargs in refused:
        with pytest.raises(error, match=words):
            mesh.run(bump, **kwargs)
        with pytest.raises(error, match=words):
            mesh.call(int, **kwargs)
    with pytest.raises(TypeError, match=r"code is a cell's Python source \(a str\), got int"):
        mesh.run(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"use mesh.call\(fn, \*args\)"):
        mesh.run(print)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"source is mesh.run\(code\)"):
        mesh.call("rank")  # type: ignore[arg-type]
    assert mesh.run("hits") == {0: 0, 1: 0, 2: 0, 3: 0}  # nothing ran
    # Transfers too: a push with a bad timeout was sent, and bound, before the wait refused it (helper-39).
    for error, words, timeout in ((ValueError, "above 0 seconds", 0), (ValueError, "finite", float("inf")),
                                  (TypeError, "a number of seconds", "5")):
        with pytest.raises(error, match=words):
            mesh.push(sent=1, timeout=timeout)
        with pytest.raises(error, match=words):
            mesh.scatter("sent", [1, 2, 3, 4], timeout=timeout)
        with pytest.raises(error, match=words):
            mesh.pull("hits", timeout=timeout)
        with pytest.raises(error, match=words):
            mesh.stacks(timeout=timeout)
    assert mesh.run("'sent' in globals()") == {0: False, 1: False, 2: False, 3: False}
    handle = mesh.run(bump, block=False)
    with pytest.raises(ValueError, match="above 0 seconds"):
        handle.result(timeout=0)
    with pytest.raises(ValueError, match="0 or more seconds"):
        handle.wait(-1)
    assert handle.result(timeout=60) == {0: 1, 1: 1, 2: 1, 3: 1}  # the refused waits lost nothing


def test_stacks_of_busy_and_idle_ranks(mesh: Mesh) -> None:
    handle = mesh.run("import time\nif rank == 1:\n    time.sleep(30)\n", block=False)
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        report = mesh.stacks()
        if any(rs == [1] and key and key[0] != "idle" and "sleep" in str(key) for rs, key in report.groups()):
            break
        time.sleep(0.1)
    text = report.text
    assert "rank 1:" in text and "line 3" in text, text
    assert "ranks 0,2,3: idle" in text, text  # short rank lists read aloud (stacks.rank_list)
    with pytest.raises(KeyboardInterrupt):
        mesh.waiter.interrupt_cell(handle.record)
        handle.result(timeout=10)
    assert mesh.run("rank", ranks=1) == {1: 1}


def test_start_timeout_fails_cleanly() -> None:
    before = worker_pids()
    with pytest.raises(MeshStartError, match="within 0"):
        Mesh(2, start_timeout=0.001)
    assert not wait_gone(worker_pids() - before - _fork_servers(), timeout=5)


def test_ranks_are_not_forked_from_the_controller(mesh: Mesh) -> None:
    pids = [s["pid"] for s in mesh.status().values()]
    parents = {int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) for pid in pids}
    assert os.getpid() not in parents
    (fork_server,) = parents
    assert fork_server in _fork_servers()
    cmdline = open(f"/proc/{fork_server}/cmdline", "rb").read().split(b"\0")
    assert b"monarch_worker.forkserver" in cmdline  # a fresh interpreter, started by exec, not a fork of this one


def test_wrong_secret_and_garbage_are_rejected(mesh: Mesh) -> None:
    import zmq

    from monarch_worker import protocol as P

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(mesh.address)
        sock.send_multipart(P.Signer(b"w" * 32).pack(P.Hello(rank=0, pid=1, host="evil")))
        sock.send_multipart([b"\x00" * 10, os.urandom(100)])
        sock.send(os.urandom(1000))
        raw = socket.create_connection(("127.0.0.1", int(mesh.address.rsplit(":", 1)[1])))
        raw.sendall(os.urandom(4096))
        raw.close()
        assert sock.poll(500) == 0  # nothing comes back to an unauthenticated peer
    finally:
        ctx.destroy(0)
    assert mesh.run("rank") == {r: r for r in range(4)}
    assert all(s["state"] == "idle" for s in mesh.status().values())


def test_result_is_a_snapshot_and_handle_result_is_stable(mesh: Mesh) -> None:
    handle = mesh.run("big = torch.zeros(100_000)\nbig", ranks=0, block=False)
    first = handle.result(timeout=30)
    mesh.run("big += 1", ranks=0)  # changing the rank's tensor in place does not change what we received
    assert float(first[0].sum()) == 0.0
    assert handle.result(timeout=1) is first


def test_keyboard_interrupt_raised_by_the_code_is_an_error_not_an_interrupt(mesh: Mesh) -> None:
    from monarch_jupyter import MeshError, RemoteError

    with pytest.raises(MeshError) as info:
        mesh.run("if rank == 2:\n    raise KeyboardInterrupt('raised by the code')\nrank")
    error = info.value.errors[2]
    assert isinstance(error, RemoteError) and not error.interrupted, error
    assert (error.ename, error.evalue) == ("KeyboardInterrupt", "raised by the code")
    assert info.value.results == {0: 0, 1: 1, 3: 3}
    # A SIGINT a rank's own code sends is an interrupt there, reported as such, with the rank and where it was.
    with pytest.raises(KeyboardInterrupt) as interrupted:
        mesh.run("import os, signal, time\nif rank == 2:\n    os.kill(os.getpid(), signal.SIGINT)\n"
                 "    time.sleep(60)\nrank")
    assert str(interrupted.value).startswith("interrupted rank 2 (it keeps its state): rank 2: "), interrupted.value
    assert interrupted.value.results == {0: 0, 1: 1, 3: 3}


def test_rank_stuck_in_a_collective_refuses_new_cells_until_released() -> None:
    """A cell that timed out while one rank could not be stopped (here it blocks SIGINT, as a long call into C
    code does; a rank in a collective that no stopped rank is part of is the same) must not let the next cell's
    collectives pair with whatever the stuck one does (a wrong result, then a hang): code is refused on every rank,
    the stuck one's or not, until the rank is released; values can still be read. (A rank stuck in a collective
    that a stopped or finished rank never issued is released by the timeout itself: test_release_interrupted.py.)"""
    from monarch_jupyter import MeshTimeoutError, RankBusyError

    with Mesh(2) as m:
        m.run("u = 7")
        with pytest.raises(MeshTimeoutError):
            m.run("import signal, time\nif rank == 0:\n    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
                  "    time.sleep(20)\n    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})\n", timeout=1)
        for ranks in (None, 1):  # rank 1 alone too: its collective would pair with whatever rank 0 issues next
            with pytest.raises(RankBusyError, match="interrupt --force --ranks 0  to release it") as info:
                m.run("u = torch.ones(1); dist.all_reduce(u); u.item()", ranks=ranks)
            assert info.value.ranks == [0]
            assert "a collective of new code on any rank would pair with the one it is stuck in" in str(info.value)
        assert m.pull("u", ranks=1) == {1: 7}  # values can still be read (a pull runs no code of the user's)
        with pytest.raises(RankBusyError, match=r"pull of 'u' was not run: rank 0 still runs .* would get to it "
                                                r"only after that. Leave it out \(--ranks 1\), or release it"):
            m.pull("u")  # rank 0 would serve it only after its stuck cell
        m.interrupt(force=True, grace=60)  # tears the group down; rank 0 stops when its call returns
        assert m.run("u = torch.ones(1); dist.all_reduce(u); u.item()", timeout=30) == {0: 2.0, 1: 2.0}
        assert m.run("rank", ranks=1) == {1: 1}


# ---- how a local rank's result reaches the notebook: records in its stdout pipe, or the socket when large


@pytest.mark.parametrize("size", [0, 100, 10_000, 100_000, 300_000])
def test_results_of_every_size_arrive_whole_after_the_cells_output(
        mesh: Mesh, capsys: pytest.CaptureFixture[str], size: int) -> None:
    # Up to 64 KiB a result travels as records behind the output (cut into PIPE_BUF pieces past 4 KiB); larger
    # ones go over the socket after sync markers. Either way every line comes first, on both streams.
    got = run(mesh, f"""
        import sys, torch
        for i in range(50):
            print(f"out {{i}}")
            print(f"err {{i}}", file=sys.stderr)
        sys.stderr.write("stderr tail, no newline")
        (bytes([rank]) * {size}, torch.full(({size} // 4,), float(rank)))
    """)
    cap = capsys.readouterr()
    for r in range(4):
        blob, tensor = got[r]
        assert blob == bytes([r]) * size
        assert tensor.shape == (size // 4,) and bool((tensor == r).all())
        assert cap.out.count(f"[rank{r}]: out ") == 50
        assert cap.err.count(f"[rank{r}]: err ") == 50
        assert f"[rank{r}]: stderr tail, no newline" in cap.err


def test_redirecting_fd_1_in_a_cell_does_not_cut_the_ranks_off(mesh: Mesh) -> None:
    run(mesh, """
        import os
        _saved_stdout = os.dup(1)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    """, ranks=1)
    try:
        assert mesh.run("rank * 2", ranks="0,1") == {0: 0, 1: 2}
    finally:
        run(mesh, "os.dup2(_saved_stdout, 1); os.close(_saved_stdout)", ranks=1)
    assert mesh.run("rank", ranks=1) == {1: 1}


def test_results_stay_whole_while_another_thread_floods_stdout(mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    run(mesh, """
        import threading, os
        _flood_stop = threading.Event()
        def _flood():
            while not _flood_stop.is_set():
                os.write(1, b"x" * 5000 + b"\\n")  # longer than PIPE_BUF: the kernel may split this write
        _flooder = threading.Thread(target=_flood, daemon=True)
        _flooder.start()
    """)
    try:
        for i in range(30):
            assert mesh.run(f"'{i}' * 3000") == {r: str(i) * 3000 for r in range(4)}
    finally:
        run(mesh, "_flood_stop.set(); _flooder.join()")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "x" in ln]
    assert lines and all(ln.endswith("x" * 100) for ln in lines)


def test_an_interrupt_that_overtakes_its_cell_stops_it_when_it_starts(mesh: Mesh) -> None:
    # Cells reach a local rank through its work pipe, interrupts through its socket: an interrupt can arrive
    # first. The rank remembers it and the cell stops as soon as it starts (the cell before it is not touched).
    from monarch_worker import protocol as P

    first = mesh.run("import time; time.sleep(0.5); 'first'", ranks=2, block=False)
    second = mesh.run("'second ran'", ranks=2, block=False)
    mesh.parts.dispatcher.post(2, P.Interrupt(second.cell_id))  # what Ctrl-C on the waiting cell sends
    assert first.result(timeout=30) == {2: "first"}
    with pytest.raises(KeyboardInterrupt, match="interrupted rank"):
        second.result(timeout=30)
    assert mesh.run("'after'", ranks=2) == {2: "after"}


def test_an_interrupt_before_the_caller_waits_still_stops_the_ranks(mesh: Mesh,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A fast cell's first output can be on screen, and the user can interrupt, before the submitting thread is in
    # its wait loop (here: right after the cell was sent, as its cell_started event is queued). The ranks must be
    # interrupted all the same, or they would go on with the cell and the next cell's output would be filed under
    # this one.
    import signal

    fired = []
    emit = mesh.events.emit

    def emit_then_interrupt(kind: str, **data: object) -> None:
        emit(kind, **data)
        if kind == "cell_started" and not fired:
            fired.append(data["cell_id"])
            signal.raise_signal(signal.SIGINT)  # as the kernel's interrupt does, at this exact moment

    monkeypatch.setattr(mesh.events, "emit", emit_then_interrupt)
    with pytest.raises(KeyboardInterrupt, match="interrupted rank"):
        mesh.run("import time\ntime.sleep(600)")
    monkeypatch.undo()
    assert fired
    assert mesh.run("'next'") == dict.fromkeys(range(4), "next")


# ---- found by a fresh user trying to break the records and the work pipe


def test_progress_from_processes_a_rank_forks_does_not_cut_its_results(mesh: Mesh) -> None:
    # A forked child inherits the rank's record writer; its reports must not reuse the rank's sequence numbers.
    got = run(mesh, """
        import multiprocessing as mp
        from monarch_worker import progress
        def _work(i):
            progress(i + 1, 4, desc="job")
            return i * i
        with mp.get_context("fork").Pool(2) as _pool:
            _out = _pool.map(_work, range(4))
        _out
    """, ranks="0,1", timeout=60)
    assert got == {0: [0, 1, 4, 9], 1: [0, 1, 4, 9]}
    assert mesh.run("rank", ranks="0,1") == {0: 0, 1: 1}


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_that_looks_like_a_marker_or_record_is_just_text(
        mesh: Mesh, capsys: pytest.CaptureFixture[str], stream: str) -> None:
    got = run(mesh, f"""
        import sys
        print("\\x1b]monarch-msg;hello world", file=sys.{stream})
        print("\\x1b]monarch-sync;hello", file=sys.{stream})
        print("after", file=sys.{stream})
        rank
    """, ranks=2, timeout=30)
    assert got == {2: 2}
    text = getattr(capsys.readouterr(), "out" if stream == "stdout" else "err")
    assert "monarch-msg;hello world" in text and "monarch-sync;hello" in text and "[rank2]: after" in text
    run(mesh, f"import sys; print('next', file=sys.{stream})", ranks=2)
    assert "[rank2]: next" in getattr(capsys.readouterr(), "out" if stream == "stdout" else "err")


def test_a_forged_partial_record_does_not_swallow_the_next_result(mesh: Mesh) -> None:
    run(mesh, r"""
        import sys
        sys.stdout.buffer.write(b"\x1b]monarch-msg;\x00\x00\x00\x03\x01abc"); sys.stdout.flush()
    """, ranks=3, timeout=30)
    assert mesh.run("'still here'", ranks=3, timeout=30) == {3: "still here"}


def test_sync_markers_never_land_in_a_file_fd_1_was_redirected_to(mesh: Mesh, tmp_path: object) -> None:
    path = f"{tmp_path}/out.log"
    run(mesh, f"""
        import os
        _f = os.open({path!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        _saved = os.dup(1)
        os.dup2(_f, 1)
        print("into the file", flush=True)
    """, ranks=0)
    try:
        assert mesh.run("b'z' * 100_000", ranks=0) == {0: b"z" * 100_000}  # a large result: markers + socket
        assert mesh.pull("_saved", ranks=0) == {0: mesh.run("_saved", ranks=0)[0]}
    finally:
        run(mesh, "os.dup2(_saved, 1); os.close(_saved); os.close(_f)", ranks=0)
    with open(path, "rb") as f:
        assert f.read() == b"into the file\n"


def test_a_partial_utf8_character_at_the_end_of_a_cell_stays_in_that_cell(
        mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    run(mesh, 'import os; os.write(1, "é".encode()[:1])', ranks="0,1")
    capsys.readouterr()
    run(mesh, 'print("next")', ranks="0,1")
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == ["[rank0]: next", "[rank1]: next"]


def test_the_work_pipe_is_out_of_reach_of_user_code(mesh: Mesh) -> None:
    # Not inherited by subprocesses, and not at fd 3, where the fork server put it, which code may close.
    got = run(mesh, """
        import gc, os, subprocess, sys
        from monarch_worker.runtime import Rank
        _rank = next(o for o in gc.get_objects() if isinstance(o, Rank))
        _ours = {os.readlink(f"/proc/self/fd/{fd}") for fd in (_rank.config.work_fd, _rank._record_fd)}
        try:
            os.close(3)
        except OSError:
            pass
        _code = ("import os\\nfor f in os.listdir('/proc/self/fd'):\\n    try: print(os.readlink('/proc/self/fd/' + f))"
                 "\\n    except OSError: pass")
        _child = subprocess.run([sys.executable, "-c", _code], close_fds=False, capture_output=True, text=True)
        (_rank.config.work_fd >= 100, sorted(_ours & set(_child.stdout.split())), _child.returncode)
    """, ranks=1)
    assert got == {1: (True, [], 0)}
    assert mesh.run("rank", ranks=1) == {1: 1}


def test_an_interrupt_while_a_cell_is_being_sent_reaches_every_rank(mesh: Mesh, capsys: pytest.CaptureFixture[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # A SIGINT in the middle of writing a cell into the ranks' work pipes is held until every rank has the cell
    # (a message cut in half would corrupt the pipe; a rank left without it would stay "running" for ever).
    import signal

    from monarch_jupyter.kernel.launch.base import WorkPipe

    original = WorkPipe.send
    calls = []

    def send(self: WorkPipe, data: bytes) -> bool:
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return original(self, data)

    monkeypatch.setattr(WorkPipe, "send", send)
    with pytest.raises(KeyboardInterrupt, match="interrupted rank"):
        mesh.run("import time\ntime.sleep(600)")
    monkeypatch.setattr(WorkPipe, "send", original)
    assert len(calls) == 4
    assert {r: s["state"] for r, s in mesh.status().items()} == dict.fromkeys(range(4), "idle")
    capsys.readouterr()
    run(mesh, "print('in order')", order="rank")
    assert capsys.readouterr().out.splitlines() == [f"[rank{r}]: in order" for r in range(4)]


def test_a_binary_record_header_in_the_output_swallows_nothing(mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    # Bytes that look exactly like a record header (with a length) but not like a record's body are text: the
    # result and the lines after them still arrive.
    got = run(mesh, r"""
        import os, struct, sys
        os.write(1, b"\x1b]monarch-msg;" + struct.pack("!IB", 100, 0))
        os.write(2, b"\x1b]monarch-msg;" + struct.pack("!IB", 4000, 0))
        print("err after", file=sys.stderr)
        'result'
    """, ranks=3, timeout=30)
    assert got == {3: "result"}
    cap = capsys.readouterr()
    # Shown as the text they are. Python's stderr and raw writes to fd 2 travel apart (the first in order with
    # stdout), so only what each stream holds is asserted, not how the two interleave.
    assert "[rank3]: err after" in cap.err.splitlines()
    assert "monarch-msg;" in cap.out and "monarch-msg;" in cap.err


def test_a_partial_escape_at_the_end_of_a_cells_stderr_stays_in_that_cell(
        mesh: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    run(mesh, 'import os; os.write(2, b"err\\x1b]monarch-")', ranks=0)
    first = capsys.readouterr().err
    run(mesh, 'import sys; print("next", file=sys.stderr)', ranks=0)
    assert "[rank0]: err" in first
    assert capsys.readouterr().err.splitlines() == ["[rank0]: next"]


def test_a_notebook_function_that_uses_a_rank_name_says_why_it_is_not_found(mesh: Mesh) -> None:
    """A function defined in the notebook keeps the notebook's globals on a rank: ``rank`` is not one of them.
    The NameError says so, and how to fix it; a function defined in a cell sees the rank's names."""
    notebook: dict = {"__name__": "__main__"}  # a notebook cell's globals
    exec("def shifted(v):\n    return v + rank\n", notebook)
    with pytest.raises(MeshError) as info:
        mesh.call(notebook["shifted"], 1, ranks=[0, 1])
    tb = info.value.errors[0].traceback
    assert "NameError: name 'rank' is not defined" in tb
    assert "'rank' is a name of this rank, but shifted() was defined in the notebook" in tb, tb
    assert "Pass rank as an argument, or define shifted() in a %%mesh cell." in tb
    run(mesh, "def shifted(v):\n    return v + rank\n")
    assert run(mesh, "shifted(1)", ranks=[0, 1]) == {0: 1, 1: 2}
    with pytest.raises(MeshError) as info:  # a name no one has: no note
        run(mesh, "def f():\n    return undefined_anywhere\nf()", ranks=[0])
    assert "is a name of this rank" not in info.value.errors[0].traceback
