"""pdb on ranks through a real Jupyter kernel: prompts are input_requests on the stdin channel, answered with
``kc.input``; the scripted forms run with allow_stdin=False, as nbval and nbconvert run notebooks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from jupyter_client.manager import KernelManager, start_new_kernel

from tests.conftest import wait_gone, worker_pids

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

TIMEOUT = 120


@dataclass
class Outcome:
    reply: dict
    prompts: list[str] = field(default_factory=list)
    stdout: str = ""
    results: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)


class Kernel:
    def __init__(self, km: KernelManager, kc: Any) -> None:
        self.km = km
        self.kc = kc
        self.out = ""  # stdout of the request running now, as it arrives

    def execute(self, code: str, answers: list[str] | None = None, allow_stdin: bool = True,
                on_prompt: Callable[[Kernel, str], str | None] | None = None) -> Outcome:
        """Run ``code``; answer each input_request from ``answers`` (or ``on_prompt``, which may answer None to
        leave the prompt alone, e.g. after interrupting the kernel)."""
        answers = list(answers or [])
        kc = self.kc
        # stop_on_error=False: a cell of its own, not aborted after an earlier error (test_kernel.execute)
        msg_id = kc.execute(code, allow_stdin=allow_stdin, stop_on_error=False)
        outcome = Outcome(reply={})
        self.out = ""
        idle = False
        deadline = time.monotonic() + TIMEOUT
        while not (idle and outcome.reply):
            assert time.monotonic() < deadline, f"no end of {code!r}; output so far:\n{self.out}"
            busy = False
            if kc.stdin_channel.msg_ready():
                busy = True
                msg = kc.get_stdin_msg(timeout=1)
                if msg["msg_type"] == "input_request":
                    prompt = msg["content"]["prompt"]
                    outcome.prompts.append(prompt)
                    answer = on_prompt(self, prompt) if on_prompt else answers.pop(0)
                    if answer is not None:
                        kc.input(answer)
            while kc.iopub_channel.msg_ready():
                busy = True
                msg = kc.get_iopub_msg(timeout=1)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream" and content["name"] == "stdout":
                    self.out += content["text"]
                elif kind == "execute_result":
                    outcome.results.append(content["data"]["text/plain"])
                elif kind == "error":
                    outcome.errors.append(content)
                elif kind == "status" and content["execution_state"] == "idle":
                    idle = True
            if kc.shell_channel.msg_ready():
                busy = True
                msg = kc.get_shell_msg(timeout=1)
                if msg["parent_header"].get("msg_id") == msg_id:
                    outcome.reply = msg["content"]
            if not busy:
                time.sleep(0.01)
        outcome.stdout = self.out
        assert not answers, f"prompts not asked: {answers}; output:\n{self.out}"
        return outcome

    def wait_output(self, text: str, timeout: float = 30.0) -> None:
        """Read IOPub (while the kernel waits at a prompt) until ``text`` was written."""
        deadline = time.monotonic() + timeout
        while text not in self.out:
            assert time.monotonic() < deadline, f"{text!r} not in output:\n{self.out}"
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                self.out += msg["content"]["text"]


@pytest.fixture(scope="module")
def kernel() -> Iterator[Kernel]:
    km, kc = start_new_kernel(kernel_name="python3", env=dict(os.environ), cwd=os.getcwd())
    k = Kernel(km, kc)
    try:
        # No live view: these tests read the ranks' lines in the streams as they come (a cell's view takes them).
        out = k.execute("%load_ext monarch\nm = %mesh start -n 4\n%config MeshMagics.live_view = 'off'\n"
                        "import json; print(json.dumps(sorted(s['pid'] for s in m.status().values())))")
        assert out.reply["status"] == "ok", out
        pids = set(__import__("json").loads(out.stdout.strip().splitlines()[-1]))
        yield k
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert not wait_gone(pids & worker_pids(), timeout=10)


def test_breakpoint_on_one_rank_of_four(kernel: Kernel) -> None:
    answers = ["p x", "ll", "w", "n", "p y", "c"]

    def person(k: Kernel, prompt: str) -> str:
        if len(answers) == 6:  # the other ranks finish, and their output shows, while rank 2 waits
            for r in (0, 1, 3):
                k.wait_output(f"[rank{r}]: done {r}")
        return answers.pop(0)

    res = kernel.execute("%%mesh\nx = rank * 10\nif rank == 2:\n    breakpoint()\nelse:\n    print('done', rank)\n"
                         "y = x + 1\ny\n", on_prompt=person)
    assert res.reply["status"] == "ok", res
    assert res.prompts == ["(Pdb rank 2) "] * 6
    assert res.results == ["{0: 1, 1: 11, 2: 21, 3: 31}"]
    text = res.stdout
    n = text.split("--- rank 2 stopped at ")[1].split(",")[0]  # "<mesh In[N]> line 6"
    cell = n.split(" line ")[0]
    assert n == f"{cell} line 6"
    assert f"> {cell}(6)<module>()\n-> y = x + 1\n" in text
    assert "20\n" in text and "21\n" in text
    assert "  3  \t    breakpoint()\n" in text and "  6  ->\ty = x + 1\n" in text  # ll: the cell's own source
    assert f"> {cell}(7)<module>()\n-> y\n" in text  # n reaches the last line (the cell's value)


def test_two_ranks_stopped_through_stdin(kernel: Kernel) -> None:
    res = kernel.execute("%%mesh\nx = rank\ndist.barrier()\nif rank in (1, 2):\n    breakpoint()\ny = x\ny\n",
                         answers=["ranks", "cast 1,2 p x * 100", "c", "p x", "c"])
    assert res.reply["status"] == "ok", res
    assert res.prompts == ["(Pdb rank 1) "] * 3 + ["(Pdb rank 2) "] * 2
    assert "* rank 1: stopped at" in res.stdout and "  rank 2: stopped at" in res.stdout
    assert "[rank1]: 100\n" in res.stdout and "[rank2]: 200\n" in res.stdout
    assert res.results == ["{0: 0, 1: 1, 2: 2, 3: 3}"]


def test_scripted_forms_without_stdin(kernel: Kernel) -> None:
    # As nbval runs a notebook: no stdin. The list answers the prompts; then the rank continues.
    res = kernel.execute('%%mesh --ranks 1 --pdb-commands "p x; p x + 1"\nx = 41\nbreakpoint()\nx + 1\n',
                         allow_stdin=False)
    assert res.reply["status"] == "ok", res
    assert res.prompts == []
    assert "(Pdb rank 1) p x\n41\n(Pdb rank 1) p x + 1\n42\n(Pdb rank 1) (no scripted pdb command left: continue)" \
        in res.stdout
    # A breakpoint nobody can answer does not hang the cell.
    res = kernel.execute("%%mesh\nbreakpoint()\nrank\n", allow_stdin=False)
    assert res.reply["status"] == "ok" and res.results == ["{0: 0, 1: 1, 2: 2, 3: 3}"]
    assert "no one can answer pdb prompts here (this frontend has no stdin)" in res.stdout
    # Post-mortem, scripted.
    res = kernel.execute("%%mesh\ndef f(a):\n    b = a + 1\n    return 1 / (a - 3)\nf(rank)\n", allow_stdin=False)
    assert res.reply["status"] == "error"
    res = kernel.execute('%mesh debug --rank 3 --commands "p a; p b; up; p rank"', allow_stdin=False)
    assert res.reply["status"] == "ok", res
    assert "--- post-mortem of rank 3 at" in res.stdout and "ZeroDivisionError: division by zero" in res.stdout
    assert "(Pdb rank 3) p a\n3\n(Pdb rank 3) p b\n4\n(Pdb rank 3) up\n" in res.stdout
    assert "(Pdb rank 3) p rank\n3\n" in res.stdout


def test_post_mortem_through_stdin(kernel: Kernel) -> None:
    res = kernel.execute("%%mesh\nz = rank * 2\nassert rank != 1, f'bad rank {rank}'\n")
    assert res.reply["status"] == "error"
    res = kernel.execute("%mesh debug", answers=["p z", "c"])
    assert res.reply["status"] == "ok", res
    assert res.prompts == ["(Pdb rank 1) "] * 2
    assert "AssertionError: bad rank 1" in res.stdout and "(Pdb rank 1) " not in res.stdout  # prompts are stdin's
    assert "\n2\n" in res.stdout
    res = kernel.execute("%mesh debug --clear")
    assert "dropped the tracebacks of rank 1" in res.stdout
    res = kernel.execute("%mesh debug")
    assert res.reply["status"] == "error" and res.reply["ename"] == "UsageError"


def test_inspect_a_busy_rank(kernel: Kernel, tmp_path: Any) -> None:
    stop = f"{tmp_path}/stop"
    code = (f"import os, time\nprogress = 0\nwhile not os.path.exists({stop!r}):\n    progress += 1\n"
            "    time.sleep(0.01)\nprogress > 0\n")
    res = kernel.execute(f"h = m.run({code!r}, ranks=[1], block=False)")
    assert res.reply["status"] == "ok", res
    try:
        deadline = time.monotonic() + 30
        while True:
            res = kernel.execute("%mesh inspect --rank 1 progress")
            assert res.reply["status"] == "ok", res
            text = res.results[0]
            if "running" in text or time.monotonic() > deadline:
                break
        assert text.startswith("rank 1 (running at <mesh cell") and "live state" in text
        assert int(text.splitlines()[-1]) >= 0
        res = kernel.execute("%mesh inspect --rank 1")
        assert res.reply["status"] == "error" and res.reply["ename"] == "UsageError"
    finally:
        open(stop, "w").close()
    res = kernel.execute("h.result(timeout=30)")
    assert res.results == ["{1: True}"]


def test_interrupt_at_the_prompt(kernel: Kernel) -> None:
    def interrupt(k: Kernel, prompt: str) -> None:
        k.km.interrupt_kernel()  # the person presses the notebook's stop button instead of answering

    res = kernel.execute("%%mesh\nx = rank\nif rank == 1:\n    breakpoint()\n    breakpoint()\nx\n",
                         on_prompt=interrupt)
    assert res.reply["status"] == "ok", res
    assert "interrupted at the debugger prompt: rank 1 continues" in res.stdout
    assert "[rank1]: stopped at" in res.stdout and "it continues: the debugger is detached" in res.stdout
    assert res.results == ["{0: 0, 1: 1, 2: 2, 3: 3}"]

    res = kernel.execute("%%mesh --on-interrupt raise\nx = rank\nif rank == 1:\n    breakpoint()\nx\n",
                         on_prompt=interrupt)
    assert res.reply["status"] == "error" and res.reply["ename"] == "KeyboardInterrupt", res
    assert "rank 1 raises KeyboardInterrupt where it stopped" in res.stdout
    res = kernel.execute("%%mesh\nrank\n")  # the mesh goes on
    assert res.results == ["{0: 0, 1: 1, 2: 2, 3: 3}"]
