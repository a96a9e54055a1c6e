"""What the user reads when ranks fail: stack report lines, death and abort errors (no processes)."""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time

import monarch_worker.live
from monarch_jupyter.errors import (
    MeshError,
    MeshTimeoutError,
    RankAbortedError,
    RankDiedError,
    RemoteError,
    TrialFailedError,
)
from monarch_jupyter.kernel.hints import restart_hint
from monarch_jupyter.kernel.recovery import InterruptReport, where_interrupted
from monarch_jupyter.kernel.routing import kept_for_death_report
from monarch_jupyter.kernel.stacks import StackReport, summarize
from monarch_jupyter.ranks import format_ranks as rank_list
from monarch_worker import protocol as P
from monarch_worker.executor import format_error, main_thread_stack, register_source

C10D = "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
LOGGER = "/usr/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"
IN_COLLECTIVE = [("<mesh In[7]>", 1, "<module>", "train()"),
                 ("<mesh In[3]>", 4, "train", "dist.all_reduce(t)"),
                 (LOGGER, 83, "wrapper", "return func(*args, **kwargs)"),
                 (C10D, 3252, "all_reduce", "work.wait()")]
IN_CELL = [("<mesh In[7]>", 4, "<module>", "dist.all_reduce(t)"),
           (LOGGER, 83, "wrapper", "return func(*args, **kwargs)"),
           (C10D, 3252, "all_reduce", "work.wait()")]
SLEEPING = [("<mesh In[7]>", 6, "<module>", "time.sleep(600)")]


def test_summaries_name_the_function_and_the_cell_line() -> None:
    assert summarize(IN_CELL) == "all_reduce at cell line 4"
    assert summarize(SLEEPING) == "time.sleep at cell line 6"  # a C function: the call on the cell's line
    assert summarize(IN_COLLECTIVE) == "all_reduce at <mesh In[3]>:4 in train"  # in a function of another cell
    assert summarize([]) == "idle"
    # A collective's error unwinding through torch's c10d logger: the helper it runs is not what the rank does.
    unwinding = [*IN_CELL[:2], (LOGGER, 96, "_get_msg_dict", "msg_dict = {")]
    assert summarize(unwinding) == "dist.all_reduce at cell line 4"
    # Interrupted while it sends a progress report: the cell's call, not the rank runtime's own frames (an editable
    # install has them outside site-packages; helper-58 saw "digest at .../worker/protocol.py:94 in _digest").
    runtime = os.path.dirname(monarch_worker.live.__file__)
    reporting = [("<mesh In[7]>", 5, "<module>", "progress(i, n, loss=loss)"),
                 (f"{runtime}/live.py", 150, "_report", "_send(msg)"),
                 (f"{runtime}/runtime.py", 130, "send", "self._write_records(msg, payload, buffers)"),
                 (f"{runtime}/protocol.py", 94, "_digest", "return hmac.digest(self._key, data, 'sha256')")]
    assert summarize(reporting) == "progress at cell line 5"
    assert StackReport([0], {0: P.Stacks(1, 5, reporting, "running")}, {}).text.splitlines()[-1] == (
        "    monarch_worker/protocol.py:94 in _digest: return hmac.digest(self._key, data, 'sha256')")


def test_report_groups_identical_stacks() -> None:
    replies = {r: P.Stacks(1, 5, IN_CELL, "running", {"name": "gloo:all_reduce", "seq": 12}) for r in (0, 1, 3)}
    replies[2] = P.Stacks(1, 5, SLEEPING, "running", {"name": "gloo:all_reduce", "seq": 11})
    replies[4] = P.Stacks(1, -1, [], "idle")
    report = StackReport([0, 1, 2, 3, 4, 5], replies, {5: "dead"})
    lines = report.text.splitlines()
    assert lines[0] == "ranks 0,1,3: all_reduce at cell line 4  [last collective: gloo:all_reduce #12]"
    assert lines[1] == "    cell line 4: dist.all_reduce(t)"
    assert lines[2] == "    torch/distributed/c10d_logger.py:83 in wrapper: return func(*args, **kwargs)"
    assert "rank 2: time.sleep at cell line 6  [last collective: gloo:all_reduce #11]" in lines
    assert "rank 4: idle" in lines and "rank 5: no answer (dead)" in lines
    assert report.summary().startswith("ranks 0,1,3: all_reduce at cell line 4  [last collective: gloo:all_reduce"
                                       " #12] / rank 2: time.sleep at cell line 6")


def test_a_line_with_several_calls_names_the_one_running() -> None:
    """The rank sends the source of the running instruction (PEP 657 positions): on a line with several calls,
    the summary names the one the rank is in, not the first on the line."""
    source = "import time\nfor i in range(3): time.sleep(-1)\n"
    register_source("<mesh In[9]>", source)
    try:
        exec(compile(source, "<mesh In[9]>", "exec"), {})
    except ValueError as e:  # raised inside time.sleep, a C function: the cell's frame is the innermost
        frames = [f for f in format_error(e)["frames"] if f[0] == "<mesh In[9]>"]  # from the cell on, as on a rank
    assert frames[-1][3:] == ("for i in range(3): time.sleep(-1)", "time.sleep(-1)"), frames
    assert summarize(frames) == "time.sleep at cell line 2"
    assert summarize([f[:4] for f in frames]) == "range at cell line 2"  # without it: the line's first call
    # A live stack (what %mesh stacks and a timeout report show) carries it too.
    source = "import threading, time\nfor i in range(3000): time.sleep(0.01) if not go.is_set() else None\n"
    register_source("<mesh In[10]>", source)
    go, started = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: (started.set(), exec(compile(source, "<mesh In[10]>", "exec"),
                                                                   {"go": go})))
    thread.start()
    started.wait(10)
    try:
        deadline, seen = time.monotonic() + 10, ""
        while time.monotonic() < deadline and seen != "time.sleep at cell line 2":  # it sleeps most of the time
            stack = main_thread_stack(sys._current_frames()[thread.ident])
            cell = [i for i, f in enumerate(stack) if f[0] == "<mesh In[10]>"]
            seen = summarize(stack[cell[0]:]) if cell else ""  # from the cell on, as on a rank
        assert seen == "time.sleep at cell line 2"
    finally:
        go.set()
        thread.join(10)


def test_rank_lists_read_aloud() -> None:
    assert rank_list([3, 0, 1]) == "0,1,3"
    assert rank_list(range(8)) == "0-7"
    assert rank_list([0, 2, 3, 4, 5]) == "0,2-5"


def test_interrupt_summary_groups_ranks_by_where_they_stopped() -> None:
    errors = {r: RemoteError(r, "KeyboardInterrupt", "", frames=SLEEPING) for r in (0, 1)}
    errors[2] = RemoteError(2, "KeyboardInterrupt", "", frames=IN_CELL)
    assert where_interrupted(errors) == "ranks 0,1: time.sleep at cell line 6 / rank 2: all_reduce at cell line 4"
    # No frame of the cell's own (the worker strips its machinery): stopped before the cell's first line ran.
    errors[3] = RemoteError(3, "KeyboardInterrupt", "", frames=[])
    assert where_interrupted(errors).endswith(" / rank 3: before the cell's first line")


def test_death_error_names_rank_status_and_last_output() -> None:
    died = RankDiedError(1, -11, "Fatal Python error: Segmentation fault\n  File \"<mesh In[3]>\", line 2", 123)
    lines = died.render()
    assert lines[0] == "[rank1] died (signal SIGSEGV)"
    assert "its last output:" in lines[2] and lines[-1] == '[rank1]     File "<mesh In[3]>", line 2'
    lost = RankDiedError(2, None, "", reason="no heartbeat for 30 s")
    assert str(lost) == "[rank2] lost (no heartbeat for 30 s)"


def test_mesh_error_folds_aborted_survivors_and_pickles() -> None:
    interrupted = RemoteError(0, "KeyboardInterrupt", "", interrupted=True)
    released = RemoteError(2, "RuntimeError", "Connection closed by peer")
    e = MeshError({1: RankDiedError(1, 3, "bye"), 0: RankAbortedError(0, [1], interrupted),
                   3: RankAbortedError(3, [1], interrupted), 2: RankAbortedError(2, [1], released)},
                  {4: 7}, hint="%mesh restart --rank 1")
    e = pickle.loads(pickle.dumps(e))
    text = e._render_traceback_()
    assert text[1] == "--- root cause: rank 1 (first failure seen) ---"
    assert "--- ranks 0,3: interrupted because rank 1 died ---" in text
    assert "--- rank 2: stopped because rank 1 died (RuntimeError: Connection closed by peer) ---" in text
    assert text[-2:] == ["(rank 4 finished; its result is in .results of this error)",
                         "%mesh restart --rank 1"]
    t = pickle.loads(pickle.dumps(MeshTimeoutError({0: released}, {1: 2}, "the cell", "rank 0: x", 3.0, "h")))
    assert (t.stacks, t.timeout, t.hint, t.results) == ("rank 0: x", 3.0, "h", {1: 2})


def test_a_failed_trial_is_told_in_one_short_line_and_pickles() -> None:
    e = MeshError({3: RemoteError(3, "ValueError", "bad lr\nsecond line", "Traceback ...\nValueError: bad lr"),
                   2: RemoteError(2, "ValueError", "bad lr", "tb"), 5: RankDiedError(5, -9, "x" * 500)},
                  {4: 1.0}, hint="h")
    t = pickle.loads(pickle.dumps(TrialFailedError.of(7, e, "sub-mesh trial1 (mesh ranks 2,3)")))
    assert str(t) == ("trial 7 on sub-mesh trial1 (mesh ranks 2,3): the cell failed on ranks 2,3: ValueError: bad lr; "
                      "rank 5: died (signal SIGKILL)")
    assert repr(t) == f"TrialFailedError({str(t)!r})"
    assert isinstance(t, MeshError) and (t.errors.keys(), t.results, t.hint) == ({3, 2, 5}, {4: 1.0}, "h")
    long = TrialFailedError.of(1, MeshError({0: RemoteError(0, "RuntimeError", "y" * 1000)}))
    assert len(str(long)) < 250 and str(long).endswith("...")


def test_a_refused_cell_says_it_was_not_run_without_the_last_output_again() -> None:
    e = pickle.loads(pickle.dumps(MeshError({1: RankDiedError(1, 3, "bye")}, hint="h", not_run=True)))
    assert str(e) == "the cell was not run, since a rank it needs is dead: [rank1] died (exit code 3)"
    assert e._render_traceback_() == [f"MeshError: {e}", "h"]  # "bye" was shown when the rank died
    two = MeshError({1: RankDiedError(1, 3), 2: RankDiedError(2, -9)}, not_run=True)
    assert str(two) == ("the cell was not run, since ranks it needs are dead: [rank1] died (exit code 3); "
                        "[rank2] died (signal SIGKILL)")


def test_crash_dump_lines_of_the_runtime_are_not_kept() -> None:
    assert not kept_for_death_report('  File "/site-packages/monarch_worker/runtime.py", line 9 in _run')
    assert not kept_for_death_report('  File "<frozen runpy>", line 88 in _run_code')
    assert not kept_for_death_report("Extension modules: numpy, torch._C (total: 2)")
    assert kept_for_death_report('  File "<mesh In[3]>", line 2 in <module>')
    assert kept_for_death_report("Fatal Python error: Segmentation fault")


def test_reports_agree_in_number_and_the_restart_hint_fits_who_is_left() -> None:
    """One rank reads "it", several "they"; when every rank is dead there are no "other ranks" keeping state, so the
    hint is a fresh mesh, not restarting ranks one by one."""
    assert "(ranks 0,1 finished; their results are in" in "\n".join(MeshError({2: RankDiedError(2, 1, "")},
                                                                                 {0: 1, 1: 2})._render_traceback_())
    assert InterruptReport(interrupted=[1], world_size=4).text == "interrupted rank 1; it keeps its state"
    assert InterruptReport(interrupted=[0, 1], world_size=4).text == "interrupted ranks 0,1; they keep their state"
    some = restart_hint([1, 3], 4)
    assert some.startswith("ranks 1,3 are dead") and "%mesh restart --rank 1,3  starts fresh processes for them" \
        in some and "the other ranks keep their state" in some
    assert restart_hint([2], 4).startswith("rank 2 is dead") and "for it " in restart_hint([2], 4)
    every = restart_hint([0, 1, 2, 3], 4)
    assert every.startswith("every rank is dead (ranks 0-3): %mesh restart  starts a fresh mesh")
    assert "other ranks" not in every and "--rank" not in every
    killed = InterruptReport(killed=[0, 1], world_size=2, grace=1.0).text
    assert "every rank is dead" in killed and "other ranks" not in killed


def test_an_interrupt_is_a_keyboard_interrupt_that_carries_the_finished_ranks_values() -> None:
    """Issue 25: ``MeshInterrupt`` (a KeyboardInterrupt, named so in the notebook) holds ``.results`` as an attribute
    of its own class, and survives pickling (a handle's result() raises it again)."""
    import pickle

    from monarch_jupyter.errors import MeshInterrupt, mesh_interrupt

    e = mesh_interrupt("interrupted rank 1", {0: 3})
    assert isinstance(e, MeshInterrupt) and isinstance(e, KeyboardInterrupt)
    assert type(e).__name__ == "KeyboardInterrupt"  # the execute_reply's ename
    assert e.results == {0: 3} and e._render_traceback_() == ["KeyboardInterrupt: interrupted rank 1"]
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is MeshInterrupt and again.results == {0: 3} and str(again) == "interrupted rank 1"


def test_a_scripts_traceback_and_report_carry_the_hint() -> None:
    import traceback

    e = MeshError({2: RemoteError(2, "RuntimeError", "Connection closed by peer")}, hint="a fresh group comes next")
    printed = "".join(traceback.format_exception(e))  # what an uncaught error prints in a script
    assert "MeshError: the cell failed on rank 2" in printed and "a fresh group comes next" in printed, printed
    assert "a fresh group comes next" not in str(e)  # a kernel's evalue (nbval compares it) stays the first line
    assert e.report() == "\n".join(e._render_traceback_()) and e.report().endswith("a fresh group comes next")
    again = pickle.loads(pickle.dumps(e))
    assert again.__notes__ == ["a fresh group comes next"]  # once, not once more per unpickling
