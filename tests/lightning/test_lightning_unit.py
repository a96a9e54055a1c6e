"""strategy="mesh" without ranks: registration, version check, mesh checks, the identity table of kept data,
prediction reassembly. Fast (a few seconds, most of it importing Lightning once)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("lightning")

from monarch_jupyter.lightning import launch, shipping  # noqa: E402
from monarch_jupyter.lightning import rank as rank_side  # noqa: E402
from monarch_jupyter.lightning.errors import LightningVersionError, MeshLightningError  # noqa: E402


def _python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_registration_is_lazy_and_reaches_both_registries() -> None:
    out = _python('''
        import sys, time
        t = time.perf_counter()
        import monarch_jupyter.lightning
        print("lightning" in sys.modules, "IPython" in sys.modules, "ipywidgets" in sys.modules)
        import lightning, pytorch_lightning
        from lightning.pytorch.strategies import StrategyRegistry
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from pytorch_lightning.strategies import StrategyRegistry as PLRegistry
        print("mesh" in StrategyRegistry, "mesh" in STRATEGY_REGISTRY, "mesh" in PLRegistry)
        from monarch_jupyter.lightning import MeshStrategy
        print(MeshStrategy.__module__, StrategyRegistry["mesh"]["strategy"] is MeshStrategy)
    ''')
    assert out.splitlines() == ["False False False", "True True True", "monarch_jupyter.lightning.unified True"]


def test_registration_when_lightning_was_imported_first() -> None:
    out = _python('''
        import lightning
        from lightning.pytorch.strategies import StrategyRegistry
        print("mesh" in StrategyRegistry)
        import monarch_jupyter.lightning
        print("mesh" in StrategyRegistry)
    ''')
    assert out.split() == ["False", "True"]


def test_rank_module_needs_no_ipython() -> None:
    out = _python('''
        import sys
        import monarch_jupyter.lightning.rank
        print(sorted(m for m in ("IPython", "ipywidgets", "lightning") if m in sys.modules))
    ''')
    assert out.strip() == "[]"


def test_version_outside_the_tested_range_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import monarch_jupyter.lightning as ml

    monkeypatch.delenv("MONARCH_LIGHTNING_ANY_VERSION", raising=False)
    monkeypatch.setattr(ml, "_version_of", lambda family: "3.1.0")
    with pytest.raises(LightningVersionError, match=r"pip install 'lightning>=2\.5,<2\.7'"):
        ml.check_version("lightning")
    with pytest.raises(LightningVersionError):
        ml.MeshStrategy()
    monkeypatch.setenv("MONARCH_LIGHTNING_ANY_VERSION", "1")
    ml.check_version("lightning")
    monkeypatch.setattr(ml, "_version_of", lambda family: "2.6.6")
    monkeypatch.delenv("MONARCH_LIGHTNING_ANY_VERSION")
    ml.check_version("lightning")


class FakeMesh:
    """What configure() reads of a mesh: world_size, running, listening, hosts(), status()."""

    def __init__(self, hosts: dict[str, list[int]], device: str = "cpu") -> None:
        self._hosts = hosts
        self.world_size = sum(len(v) for v in hosts.values())
        self.running, self.listening = True, False
        self.device = device
        self.generation = 1
        self.calls: list = []
        self.subs: dict = {}

    def call(self, fn, *args, **kwargs):  # the warm-up's background import of Lightning on the ranks
        self.calls.append((fn.__name__, args))

    def hosts(self) -> dict[str, list[int]]:
        return self._hosts

    def status(self) -> dict[int, dict]:
        return {r: {"device": self.device, "state": "idle"} for rs in self._hosts.values() for r in rs}


def _strategy(mesh: FakeMesh, devices: int, num_nodes: int = 1, gpu: bool = False):
    from monarch_jupyter.lightning import MeshStrategy

    s = MeshStrategy(mesh=mesh)
    s.parallel_devices = [torch.device("cuda", i) if gpu else torch.device("cpu") for i in range(devices)]
    s.num_nodes = num_nodes
    return s


def test_configure_checks_the_world_and_derives_nodes_from_hosts() -> None:
    two_hosts = FakeMesh({"a": [0, 1], "b": [2, 3]})
    s = _strategy(two_hosts, devices=2)
    launch.configure(s, "Trainer")
    assert s.num_nodes == 2 and s.node_ranks == {0: 0, 1: 0, 2: 1, 3: 1}
    assert two_hosts.calls == [("warm_up", ("lightning",))]  # once per started mesh
    assert s.distributed_sampler_kwargs["num_replicas"] == 4
    with pytest.raises(MeshLightningError, match=r"wants 8 ranks, but the mesh has 4 .*devices=2, num_nodes=2"):
        launch.configure(_strategy(two_hosts, devices=4, num_nodes=2), "Trainer")
    with pytest.raises(MeshLightningError, match=r"wants 3 ranks, but the mesh has 2.*devices=2"):
        launch.configure(_strategy(FakeMesh({"a": [0, 1]}), devices=3), "Trainer")
    with pytest.raises(MeshLightningError, match="2 ranks on every host"):
        launch.configure(_strategy(FakeMesh({"a": [0, 1, 2], "b": [3]}), devices=2), "Trainer")
    with pytest.raises(MeshLightningError, match=r"accelerator='gpu'.*ranks 0,1 have no GPU.*accelerator='cpu'"):
        launch.configure(_strategy(FakeMesh({"a": [0, 1]}), devices=2, gpu=True), "Trainer")
    launch.configure(_strategy(FakeMesh({"a": [0, 1]}, device="cuda:0"), devices=2, gpu=True), "Trainer")


def test_kept_objects_follow_identity_and_in_place_changes() -> None:
    kept = shipping.KeptObjects()
    data = torch.randn(512, 1024)  # 2 MiB
    small = torch.randn(10)
    job = {"data": data, "again": data, "small": small, "param": torch.nn.Parameter(torch.randn(256, 256))}
    first = shipping.pickle_job(job, kept)
    assert len(first.tokens) == 1 and list(first.new.values())[0] is data
    assert len(first.slots) == 1  # the parameter (256 KiB) travels out of band; the small tensor in the pickle
    kept.sent.update(first.tokens)
    second = shipping.pickle_job(job, kept)
    assert second.tokens == first.tokens and not second.new
    data.add_(1)  # changed in place: a new token, sent again; the old one is dropped on the ranks
    third = shipping.pickle_job(job, kept)
    assert third.tokens != first.tokens and third.new and first.tokens[0] in kept.take_dropped()
    kept.sent.update(third.tokens)
    token = third.tokens[0]
    del job, data, first, second, third  # the notebook lets go of the data set: the ranks drop it next time
    import gc

    gc.collect()
    assert token in kept.take_dropped() and len(kept) == 0

    # The rank's side: the job's references resolve to the kept objects and slots.
    kept = shipping.KeptObjects()
    data = torch.arange(300_000, dtype=torch.float32)
    ship = shipping.pickle_job({"x": data, "p": torch.nn.Parameter(torch.ones(100_000))}, kept)
    rank_side._keep(ship.new, [])
    assert rank_side._missing(ship.tokens) == []
    import io

    loaded = rank_side._JobUnpickler(io.BytesIO(ship.data), ship.slots).load()
    assert torch.equal(loaded["x"], data) and isinstance(loaded["p"], torch.nn.Parameter)
    loaded["x"].mul_(2)  # a rank changed its copy in place: it counts as missing, so the notebook's comes again
    assert rank_side._missing(ship.tokens) == ship.tokens


def test_arrays_are_kept_and_checked_by_content() -> None:
    np = pytest.importorskip("numpy")
    kept = shipping.KeptObjects()
    arr = np.ones((1024, 512), dtype=np.float32)
    a = shipping.pickle_job([arr], kept)
    kept.sent.update(a.tokens)
    assert not shipping.pickle_job([arr], kept).new
    arr[3, 3] = 5
    assert shipping.pickle_job([arr], kept).new


def test_predictions_come_back_in_dataloader_order() -> None:
    x = torch.arange(10.0).unsqueeze(1)
    # Rank r of 2 predicted samples r, r+2, ... in batches of 2 (Lightning's UnrepeatedDistributedSampler).
    outputs = []
    for r in range(2):
        idx = list(range(r, 10, 2))
        batches = [idx[i:i + 2] for i in range(0, len(idx), 2)]
        outputs.append(rank_side.PredictOutput([x[b] * 10 for b in batches], {0: batches}))
    preds = launch.assemble_predictions(outputs)
    assert [p.squeeze(1).tolist() for p in preds] == [[0, 10], [20, 30], [40, 50], [60, 70], [80, 90]]
    dicts = [rank_side.PredictOutput([{"y": x[b], "i": torch.tensor(b)} for b in o.batch_indices[0]],
                                     o.batch_indices) for o in outputs]
    assert torch.equal(torch.cat([p["i"] for p in launch.assemble_predictions(dicts)]), torch.arange(10))
    # Without a batch dimension: batch by batch, ordered by their first sample.
    scalars = [rank_side.PredictOutput([float(b[0]) for b in o.batch_indices[0]], o.batch_indices) for o in outputs]
    assert launch.assemble_predictions(scalars) == [0.0, 1.0, 4.0, 5.0, 8.0, 9.0]


def test_strategy_pickles_without_its_mesh() -> None:
    from monarch_jupyter.lightning import MeshStrategy

    s = MeshStrategy(mesh=FakeMesh({"a": [0, 1]}))
    s.parallel_devices = [torch.device("cpu")] * 2
    s._configure_launcher()
    clone = pickle.loads(pickle.dumps(s))
    assert clone.mesh is None and clone._launcher is None and type(clone) is MeshStrategy


def test_folded_traceback_keeps_the_users_frames_and_where_a_library_raised() -> None:
    import os

    import lightning

    from monarch_jupyter.lightning import reports

    lib = os.path.dirname(lightning.__file__)
    ours = os.path.dirname(rank_side.__file__)

    def frame(path: str, fn: str) -> str:
        return f'  File "{path}", line 1, in {fn}\n    {fn}()\n    ^^^^\n'

    text = ("Traceback (most recent call last):\n" + frame(f"{ours}/rank.py", "run_job")
            + "".join(frame(f"{lib}/trainer/trainer.py", f"f{i}") for i in range(20))
            + frame("/tmp/ipykernel_1/2.py", "training_step")
            + "".join(frame(f"{os.path.dirname(torch.__file__)}/nn/x.py", f"t{i}") for i in range(5))
            + "RuntimeError: boom\n")
    folded = reports.fold_traceback(text, rank=1)
    lines = folded.splitlines()
    assert lines[1] == "  [... 21 frames in monarch_jupyter, lightning: %mesh debug --rank 1 shows them]"
    assert lines[2] == '  File "/tmp/ipykernel_1/2.py", line 1, in training_step'
    assert lines[5] == "  [... 2 frames in torch: %mesh debug --rank 1 shows them]"
    assert [line for line in lines if "File" in line][-3:] == [
        f'  File "{os.path.dirname(torch.__file__)}/nn/x.py", line 1, in t{i}' for i in (2, 3, 4)]
    assert lines[-1] == "RuntimeError: boom"
    # The rendered error: folded, the cell named; the full traceback stays, and it pickles.
    err = reports.FoldedRemoteError.of(launch.RemoteError(1, "RuntimeError", "boom", text),
                                       {"/tmp/ipykernel_1/2.py": "<cell In[4]>"})
    rendered = err.render()
    assert rendered[2] == '[rank1]   File "<cell In[4]>", line 1, in training_step' and len(rendered) == len(lines)
    assert pickle.loads(pickle.dumps(err)).render() == rendered and err.traceback == text
    # Not a traceback, or only library frames: unchanged but for the fold.
    assert reports.fold_traceback("ValueError: x") == "ValueError: x"
    only_lib = reports.fold_traceback("Traceback (most recent call last):\n" + frame(f"{lib}/a.py", "a") * 5
                                      + "ValueError: x\n")
    assert only_lib.count('  File "') == 3 and "[... 2 frames in lightning: %mesh debug shows them]" in only_lib


def test_a_fault_tolerant_fit_is_refused_naming_what_is_missing_and_what_works() -> None:
    from monarch_jupyter.lightning import MeshStrategy

    with pytest.raises(MeshLightningError) as info:
        MeshStrategy(fault_tolerant=True)
    text = str(info.value)
    assert "torchft Manager that forms a quorum at every step" in text, text
    assert "%%mesh --async --rejoin" in text and "--on-rank-death restart --torchft" in text, text
    assert "fit(..., ckpt_path='last')" in text, text
    assert MeshStrategy(fault_tolerant=False).strategy_name == "mesh"
