"""A sweep on sub-meshes with Optuna (issue 29, item 3, minimal): ``monarch_jupyter.sweep`` on real local ranks.
Trials lease free sub-meshes (two at once on four ranks), run collectives there with the sub-mesh's numbering, and
give them back whatever happens: a pruned and a failed trial are recorded as such and the sweep goes on; the mesh
is one group of every rank afterwards, its namespaces kept."""

from __future__ import annotations

from typing import Any

import pytest

from monarch_jupyter import Mesh, sweep

optuna = pytest.importorskip("optuna")

pytestmark = pytest.mark.slow

WAIT = 120.0


def test_trials_lease_sub_meshes_and_pruned_or_failed_ones_do_not_stop_the_sweep() -> None:
    def objective(trial: Any, sub: Any) -> float:
        x = trial.suggest_int("x", 0, 7)
        if trial.number == 1:
            raise optuna.TrialPruned()
        if trial.number == 2:
            sub.run("raise ValueError('a bad trial')")
        # The sum of x * (rank + 1) over the sub-mesh's 2 ranks: 3x, only if its group is the sub-mesh's.
        got = sub.run(f"t = torch.tensor([{x} * (rank + 1.0)])\ndist.all_reduce(t)\n(world_size, t.item())")
        assert got == {0: (2, 3.0 * x), 1: (2, 3.0 * x)}, got
        trial.report(3.0 * x, 0)
        return 3.0 * x

    with Mesh(4, start_timeout=WAIT) as m:
        m.run("kept = rank")
        study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        assert sweep(m, objective, study, n_trials=6, ranks_per_trial=2) is study
        states = {t.number: t.state for t in study.trials}
        assert len(states) == 6
        assert states[1] == optuna.trial.TrialState.PRUNED and states[2] == optuna.trial.TrialState.FAIL
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        assert len(done) == 4 and all(t.value == 3.0 * t.params["x"] for t in done)
        assert {t.user_attrs["sub_mesh"] for t in study.trials} == {"trial0", "trial1"}  # both sub-meshes leased
        assert {tuple(t.user_attrs["ranks"]) for t in study.trials} == {(0, 1), (2, 3)}
        assert m.subs == {}  # merged back
        assert m.run("t = torch.ones(1)\ndist.all_reduce(t)\n(world_size, t.item(), kept)") == {
            r: (4, 4.0, r) for r in range(4)}


def test_bad_sweeps_are_refused_and_leave_the_mesh_usable() -> None:
    with Mesh(4, start_timeout=WAIT) as m:
        study = optuna.create_study()
        with pytest.raises(ValueError, match="must divide"):
            sweep(m, lambda t, s: 0.0, study, n_trials=2, ranks_per_trial=3)
        with pytest.raises(ValueError, match="n_trials"):
            sweep(m, lambda t, s: 0.0, study, n_trials=0, ranks_per_trial=2)
        assert m.run("world_size") == dict.fromkeys(range(4), 4)
