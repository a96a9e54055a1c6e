"""Output folding on a real mesh: past ``output_fold`` ranks, a line that every rank prints alike shows once with
the ranks' range; a line whose value differs per rank shows once per rank; at or below the threshold nothing
folds."""

from __future__ import annotations

import pytest

from monarch_jupyter import Mesh
from monarch_jupyter.kernel import cells


def test_identical_lines_fold_past_the_threshold(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Lines wait FOLD_WINDOW (0.1 s) for the same line from other ranks; on a loaded machine a rank may print later
    # than that, and its line then shows on its own (a latency trade-off, not what this test checks). With a window
    # longer than the cell, lines fold when the cell ends, whatever the scheduling.
    monkeypatch.setattr(cells, "FOLD_WINDOW", 600.0)
    # A mesh of its own: the session's (tests/conftest.py) is stopped by tests that unload the extension.
    mesh = Mesh(4, output_fold=2, start_timeout=120)  # a 4-rank cell is "many ranks" here
    try:
        mesh.run("print('epoch 1 done'); print('loss', rank); print('epoch 2 done')")
        out = capsys.readouterr().out
        assert out.count("[rank0-3]: epoch 1 done") == 1 and out.count("[rank0-3]: epoch 2 done") == 1
        for r in range(4):
            assert f"[rank{r}]: loss {r}" in out  # values differ: never folded
        assert out.index("epoch 1 done") < out.index("[rank0]: loss 0") < out.index("epoch 2 done")
        mesh.run("print('only some')", ranks="0,1")  # 2 ranks: not past the threshold
        out = capsys.readouterr().out
        assert "[rank0]: only some" in out and "[rank1]: only some" in out
        mesh.output_fold = 0  # off
        mesh.run("print('epoch 3 done')")
        assert capsys.readouterr().out.count("epoch 3 done") == 4
    finally:
        mesh.stop()
