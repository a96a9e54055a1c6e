"""The reader of the ranks' output pipes rests between reads only while output floods in (launch/pacing.py)."""

from __future__ import annotations

from monarch_jupyter.kernel.launch.pacing import ReadPacer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def pacer(clock: Clock) -> ReadPacer:
    return ReadPacer(rate=1_000_000, pause=0.004, clock=clock, sleep=clock.sleep)


def test_a_trickle_of_output_never_waits() -> None:
    """A cell's result and a line now and then: read as soon as they come, however many there are."""
    clock = Clock()
    p = pacer(clock)
    for _ in range(1000):
        clock.now += 0.01  # a read every 10 ms ...
        p.before_select()
        p.read(2000, full=False)  # ... of 2 kB: 200 kB/s
    assert clock.slept == [] and not p.flooding


def test_a_burst_after_a_quiet_spell_is_read_at_once() -> None:
    clock = Clock()
    p = pacer(clock)
    clock.now += 5.0
    p.before_select()
    p.read(60_000, full=False)  # a burst: the time before it was quiet
    clock.now += 0.001
    p.before_select()
    assert clock.slept == []


def test_a_flood_is_read_in_batches_until_it_ends() -> None:
    """Ranks write 4 MB/s: each read takes what gathered since the last one. The reader soon rests before each look
    at the pipes, so reads are few and large; once the flood ends it reads at once again."""
    clock = Clock()
    p = pacer(clock)
    last, sizes = clock.now, []
    for _ in range(200):
        p.before_select()
        size = int(4e6 * (clock.now - last)) or 400
        last = clock.now
        p.read(size, full=False)
        sizes.append(size)
        clock.now += 0.0001  # routing what was read
    assert p.flooding and len(clock.slept) >= 150  # after its first 4 ms, before every look at the pipes
    assert min(sizes[-100:]) >= 16_000  # 4 ms of output a read, not 400 bytes
    rests = len(clock.slept)
    clock.now += 1.0  # the flood ended
    p.before_select()
    p.read(100, full=False)
    clock.now += 0.01
    p.before_select()
    assert not p.flooding and len(clock.slept) == rests


def test_a_full_read_is_followed_at_once() -> None:
    """A read that filled its buffer: the writer waits for the reader, which must not rest."""
    clock = Clock()
    p = pacer(clock)
    for _ in range(20):
        p.before_select()
        p.read(1 << 16, full=True)
        clock.now += 0.001
    assert clock.slept == []
