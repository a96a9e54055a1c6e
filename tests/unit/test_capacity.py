"""What one host can carry of local ranks (issue 24, 6a): a start past it is refused before anything runs, with
what to expect and the way out; and what many starting ranks print alike shows once."""

from __future__ import annotations

import pytest

from monarch_jupyter.kernel import config
from monarch_jupyter.kernel.launch.capacity import IDLE_RANK_BYTES, RANKS_PER_CORE, check_host_capacity
from monarch_jupyter.kernel.parts import build

GIB = 1 << 30
ROOMY = (2, 64 * GIB, 1 << 20)  # cores, available memory, open files


def test_up_to_the_limits_a_start_goes_ahead() -> None:
    check_host_capacity(RANKS_PER_CORE * 2, ROOMY)
    check_host_capacity(1, (1, 0, 1024))  # memory unknown (not Linux): not checked


@pytest.mark.parametrize(("nproc", "limits", "says"), [
    (RANKS_PER_CORE * 2 + 1, ROOMY, "65 ranks on 2 CPU cores, more than 32 per core (which start in seconds)"),
    (100, (64, 99 * IDLE_RANK_BYTES, 1 << 20), "GiB of memory for the idle ranks alone"),
    (1000, (1000, 64 * GIB, 1024), "open files per rank for its process group's connections (the limit is 1024: "
                                   "raise it with  ulimit -n)"),
])
def test_past_a_limit_the_message_says_which_what_to_expect_and_the_way_out(
        nproc: int, limits: tuple[int, int, int], says: str) -> None:
    with pytest.raises(ValueError) as info:
        check_host_capacity(nproc, limits)
    message = str(info.value)
    assert message.startswith(f"{nproc} ranks on this host are more than it can carry: "), message
    assert says in message, message
    assert "takes minutes" in message and "%mesh start --force  (Mesh(..., oversubscribe=True))" in message
    with pytest.raises(ValueError) as info:  # %mesh scale has no --force: its way out is another size
        check_host_capacity(nproc, limits, scaling=True)
    assert "Scale to fewer ranks" in str(info.value) and "start anyway" not in str(info.value)


def test_lines_many_starting_ranks_print_alike_show_once(capsys: pytest.CaptureFixture[str]) -> None:
    parts = build(16, config.make_options(), None)
    state = parts.state
    state.new_generation(bytes(32))
    state.held_output = []
    with state.lock:
        for r in range(16):
            parts.router.route_lines(state.ranks[r], "stderr", ["Exception raised from recvBytes at Utils.hpp:784",
                                                                "frame #0: c10::Error::Error + 0x9d", f"rank {r} says"])
    parts.writer.flush()
    assert capsys.readouterr().err == ""  # held while the ranks start
    parts.lifecycle.release_held(final=True)
    parts.writer.flush()
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["[rank0-15]: Exception raised from recvBytes at Utils.hpp:784",
                       "[rank0-15]: frame #0: c10::Error::Error + 0x9d"], err
    assert sorted(err[2:]) == sorted(f"[rank{r}]: rank {r} says" for r in range(16))
    assert state.held_output is None  # later lines are written as they come
