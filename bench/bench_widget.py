"""Cost of the live per-rank dashboard, measured through a real Jupyter kernel (what a notebook user feels).

    python bench/bench_widget.py [--n 4] [--cells 60] [--lines 10000] [--no-peers] [--reference DIR] [--trivial-only]
                                 [--repeat R] [--json PATH]

For a mesh of N ranks in one ipykernel, driven by jupyter_client:
- trivial cell (`x = 1`) round trip, execute request to idle, median of interleaved runs:
  `%%mesh` (dashboard on) vs `%%mesh --no-widget` (off); the ratio is the dashboard's cost. Also the time the
  kernel itself spends in the magic (timed inside the kernel, no client in the loop).
- flood: every rank prints LINES lines in one cell, dashboard on vs off: cell time, lines received on IOPub
  (each rank's lines counted and checked in order: none lost), dashboard updates sent, and the kernel's
  responsiveness during the flood (max and median round trip of kernel_info on the control channel, sampled
  every 100 ms). Then the same lines paced over ~2 s, where the dashboard ticks (at most 4 updates a second).
  ``--repeat R`` floods each variant R times, the variants interleaved, and pools the round trips of all R (the
  goal line compares the medians of ours and ipyparallel's).
- peer, same kernel, same run: ipyparallel's `%%px` with N engines for the trivial cell and the flood.
- reference (``--reference DIR``, e.g. a checkout of main): the trivial-cell measurements again, in the same run,
  in a second kernel that imports monarch_jupyter from DIR; cells alternate between the two kernels so that load
  from elsewhere hits both alike. Prints before (DIR) and after (this checkout) and their ratio.
The issue's 400k-line flood is ``--n 4 --lines 100000``. ``--json PATH`` also writes every figure (seconds) as JSON.
Wall-clock numbers on a shared 2-core machine are noisy; compare ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import statistics
import sys
import threading
import time
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


class Kernel:
    """A python3 kernel (inheriting this environment, PYTHONPATH included) and a client of it."""

    def __init__(self, pythonpath: str | None = None) -> None:
        from jupyter_client.manager import start_new_kernel

        env = dict(os.environ)
        if pythonpath:  # this package imported from another checkout (monarch_worker through its .typecheck link)
            extra = [pythonpath, os.path.join(pythonpath, ".typecheck")]
            env["PYTHONPATH"] = os.pathsep.join(p for p in (*extra, env.get("PYTHONPATH", "")) if p)
        self.km, self.kc = start_new_kernel(kernel_name="python3", startup_timeout=120, env=env)

    def execute(self, code: str, timeout: float = 300.0) -> tuple[float, list[dict]]:
        """Run ``code``; (seconds from request to idle, IOPub messages of it). Raises on a cell error."""
        t0 = time.perf_counter()
        msg_id = self.kc.execute(code)
        msgs = []
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            msgs.append(msg)
            if msg["msg_type"] == "error":
                raise RuntimeError("\n".join(msg["content"]["traceback"]))
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return time.perf_counter() - t0, msgs

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


class ControlProbe(threading.Thread):
    """Round trips of kernel_info_request on the control channel every ``interval`` seconds, in seconds."""

    def __init__(self, kc: Any, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.kc, self.interval = kc, interval
        self.samples: list[float] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            msg = self.kc.session.msg("kernel_info_request")
            t0 = time.perf_counter()
            self.kc.control_channel.send(msg)
            while True:
                try:
                    reply = self.kc.control_channel.get_msg(timeout=30)
                except queue.Empty:
                    self.samples.append(float("inf"))
                    break
                if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                    self.samples.append(time.perf_counter() - t0)
                    break
            self._done.wait(self.interval)

    def stop(self) -> list[float]:
        self._done.set()
        self.join(40)
        return self.samples


def count_lines(msgs: list[dict], n: int, lines: int) -> tuple[int, bool]:
    """Lines `L <rank> <i>` in the output; True when every rank's lines all came, in order.

    Output is stream messages (ours with --no-widget), or display data updated in place by display id (the text/plain
    of a cell's view; ipyparallel's %%px): the last version of each display counts.
    """
    parts, displays = [], {}
    for m in msgs:
        c = m["content"]
        if m["msg_type"] == "stream":
            parts.append(c["text"])
        elif m["msg_type"] in ("display_data", "update_display_data"):
            key = c.get("transient", {}).get("display_id") or id(m)
            displays[key] = c["data"].get("text/plain", "")
    text = "".join(parts) + "\n".join(displays.values())
    per_rank: dict[int, list[int]] = {r: [] for r in range(n)}
    for r, i in re.findall(r"L (\d+) (\d+)$", text, re.M):
        per_rank.setdefault(int(r), []).append(int(i))
    total = sum(len(v) for v in per_rank.values())
    return total, all(v == list(range(lines)) for v in per_rank.values())


def widget_updates(msgs: list[dict]) -> tuple[int, int]:
    """(dashboard updates, bytes of their HTML) among ``msgs``: the table, the charts and the cell's output."""
    values = [m["content"]["data"].get("state", {}).get("value", "") for m in msgs if m["msg_type"] == "comm_msg"]
    values = [v for v in values if isinstance(v, str) and ("mj-dashboard" in v or "mj-rank-output" in v
                                                           or "mj-charts" in v or "mj-outputs" in v)]
    return len(values), sum(len(v) for v in values)


FLOOD = "for i in range({lines}):\n    print(f'L {{rank}} {{i}}')\n"
# The same lines in 20 bursts over about 2 s, so the dashboard ticks while output streams.
PACED = "import time\nfor i in range({lines}):\n    print(f'L {{rank}} {{i}}')\n    if i % ({lines} // 20) == 0:\n" \
        "        time.sleep(0.1)\n"


def flood(kernel: Kernel, magic: str, n: int, lines: int, body: str = FLOOD) -> dict[str, Any]:
    probe = ControlProbe(kernel.kc)
    probe.start()
    seconds, msgs = kernel.execute(f"{magic}\n" + body.format(lines=lines))
    samples = probe.stop()
    got, in_order = count_lines(msgs, n, lines)
    updates, nbytes = widget_updates(msgs)
    return {"s": seconds, "lines": got, "in_order": in_order, "updates": updates, "bytes": nbytes,
            "control_max_s": max(samples) if samples else float("nan"),
            "control_median_s": statistics.median(samples) if samples else float("nan"), "control_s": samples}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One figure for repeated floods of one variant: the median time, the fewest lines (in order only if every run
    was), the median updates, and the control channel's round trips of all runs together (their median and max)."""
    samples = [x for r in runs for x in r["control_s"]]
    return {"s": statistics.median(r["s"] for r in runs), "lines": min(r["lines"] for r in runs),
            "in_order": all(r["in_order"] for r in runs), "updates": statistics.median(r["updates"] for r in runs),
            "bytes": statistics.median(r["bytes"] for r in runs),
            "control_max_s": max(samples) if samples else float("nan"),
            "control_median_s": statistics.median(samples) if samples else float("nan"),
            "runs": [{k: v for k, v in r.items() if k != "control_s"} for r in runs]}


def repeated(variants: dict[str, tuple[Kernel, str, str]], n: int, lines: int, repeat: int) -> dict[str, dict]:
    """Each variant (kernel, magic, body) ``repeat`` times, the variants interleaved so that load from elsewhere hits
    them alike; pooled per variant."""
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in variants}
    for _ in range(repeat):
        for key, (kernel, magic, body) in variants.items():
            runs[key].append(flood(kernel, magic, n, lines, body))
    return {key: pooled(r) for key, r in runs.items()}


def trivial(kernel: Kernel, magics: dict[str, str], cells: int, other: Kernel | None = None) -> dict[str, float]:
    """Median round trip of ``x = 1`` per magic line, the magics interleaved so drift hits them alike, and their
    order reversed every other round (the first cell after a switch of kernel or magic is slower: run first each
    time, the same magic measured 0.4-0.6 ms slower than itself here); with ``other``, the same in that kernel too,
    alternating (keys "ref:on", "ref:off")."""
    kernels = [("", kernel)] + ([("ref:", other)] if other is not None else [])
    for _, k in kernels:
        for line in magics.values():
            for _ in range(5):
                k.execute(f"{line}\nx = 1")
    times: dict[str, list[float]] = {p + k: [] for p, _ in kernels for k in magics}
    for i in range(cells):
        for prefix, k in kernels[::-1] if i % 2 else kernels:
            for key, line in list(magics.items())[::-1] if i % 2 else magics.items():
                times[prefix + key].append(k.execute(f"{line}\nx = 1")[0])
    return {k: statistics.median(v) for k, v in times.items()}


IN_KERNEL = """
import json as _json, statistics as _st, time as _time
_ip = get_ipython()
_t = {{"on": [], "off": []}}
for _ in range({cells}):
    for _key, _line in (("on", ""), ("off", "--no-widget")):
        _t0 = _time.perf_counter()
        _ip.run_cell_magic("mesh", _line, "x = 1")
        _t[_key].append(_time.perf_counter() - _t0)
print("IN_KERNEL" + _json.dumps({{k: _st.median(v) for k, v in _t.items()}}))
"""


def trivial_in_kernel(kernel: Kernel, cells: int) -> dict[str, float]:
    """Median seconds the kernel spends in ``%%mesh x = 1`` with the dashboard on and off (no client)."""
    _, msgs = kernel.execute(IN_KERNEL.format(cells=cells))
    text = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")
    import json

    return json.loads(text.split("IN_KERNEL", 1)[1].splitlines()[0])


PEER_START = """
import sys
sys.path.insert(0, {bench!r})
import ipyparallel as ipp
import peers  # bench/peers.py: stops the cluster and kills anything it left
cluster = ipp.Cluster(n={n}, log_level=40)
rc = cluster.start_and_connect_sync()
rc[:].execute("import torch", block=True)
rc[:].scatter("rank", rc.ids, flatten=True, block=True)
_dv = rc[:]
_dv.block = True  # %%px waits for the engines, as %%mesh does
_dv.activate()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4, help="ranks (and ipyparallel engines)")
    ap.add_argument("--cells", type=int, default=60, help="trivial cells timed per variant")
    ap.add_argument("--lines", type=int, default=10000, help="lines each rank prints in the flood")
    ap.add_argument("--no-peers", action="store_true", help="skip ipyparallel")
    ap.add_argument("--reference", default=None, help="a checkout (folder) of monarch_jupyter to compare with")
    ap.add_argument("--trivial-only", action="store_true", help="only the trivial-cell measurements")
    ap.add_argument("--repeat", type=int, default=1, help="floods of each variant, interleaved; the control channel's "
                    "round trips of all of them are pooled (a shared machine's load comes and goes)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every figure (seconds) to PATH as JSON")
    args = ap.parse_args()
    n, lines = args.n, args.lines

    kernel = Kernel()
    ref = Kernel(os.path.abspath(args.reference)) if args.reference else None
    peer_up = False
    try:
        for k in (kernel, ref):
            if k is not None:
                k.execute("%load_ext monarch_jupyter\n%config MeshMagics.stream_order = 'rank'")
                k.execute(f"_m = %mesh start -n {n}")
        if ref is not None:
            _, msgs = ref.execute("import monarch_jupyter, monarch_worker; print(monarch_jupyter.__file__, "
                                  "monarch_worker.__file__)")
            where = "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream").strip()
            print(f"reference kernel imports {where}")
        if args.trivial_only:
            args.no_peers = True
        magics = {"on": "%%mesh", "off": "%%mesh --no-widget"}
        if not args.no_peers:
            try:
                kernel.execute(PEER_START.format(bench=BENCH_DIR, n=n))
                peer_up = True
                magics["ipyparallel"] = "%%px"
            except RuntimeError as e:
                print(f"ipyparallel: skipped ({str(e).splitlines()[-1][:200]})")
        lat = trivial(kernel, magics, args.cells, ref)
        inner = trivial_in_kernel(kernel, args.cells)
        ref_inner = trivial_in_kernel(ref, args.cells) if ref is not None else None
        floods: dict[str, dict[str, Any]] = {}
        paced: dict[str, dict[str, Any]] = {}
        if not args.trivial_only:
            variants = {"on": (kernel, "%%mesh", FLOOD), "off": (kernel, "%%mesh --no-widget", FLOOD)}
            if peer_up:
                variants["ipyparallel"] = (kernel, "%%px", FLOOD)
            if ref is not None:
                variants["before:on"] = (ref, "%%mesh", FLOOD)
                variants["before:off"] = (ref, "%%mesh --no-widget", FLOOD)
            floods = repeated(variants, n, lines, args.repeat)
            variants = {"on": (kernel, "%%mesh", PACED), "off": (kernel, "%%mesh --no-widget", PACED)}
            if ref is not None:
                variants["before:on"] = (ref, "%%mesh", PACED)
            paced = repeated(variants, n, lines, args.repeat)
    finally:
        try:
            if peer_up:
                kernel.execute("peers._ipp_stop(cluster, rc)")
            kernel.execute("%mesh stop")
            if ref is not None:
                ref.execute("%mesh stop")
        finally:
            kernel.close()
            if ref is not None:
                ref.close()

    print(f"live dashboard cost: {n} ranks, {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
          f"through a real kernel (execute request -> idle)")
    print(f"  trivial cell, %%mesh (dashboard on)       {lat['on'] * 1e3:8.2f} ms")
    print(f"  trivial cell, %%mesh --no-widget          {lat['off'] * 1e3:8.2f} ms   "
          f"on/off = {lat['on'] / lat['off']:.2f}x  (+{(lat['on'] - lat['off']) * 1e3:.2f} ms)")
    print(f"  same, time spent in the kernel's magic    on {inner['on'] * 1e3:.2f} ms, off {inner['off'] * 1e3:.2f} ms"
          f"   on/off = {inner['on'] / inner['off']:.2f}x  (+{(inner['on'] - inner['off']) * 1e3:.2f} ms)")
    if ref_inner is not None:
        before, after = lat["ref:on"] - lat["ref:off"], lat["on"] - lat["off"]
        print(f"  before ({args.reference}): %%mesh {lat['ref:on'] * 1e3:.2f} ms, --no-widget "
              f"{lat['ref:off'] * 1e3:.2f} ms: dashboard +{before * 1e3:.2f} ms; in the kernel's magic "
              f"+{(ref_inner['on'] - ref_inner['off']) * 1e3:.2f} ms")
        through = f"{after / before:.2f}x" if before > 2e-4 else "n/a (before's own on-off is within the noise)"
        print(f"  after (this checkout): dashboard +{after * 1e3:.2f} ms through the kernel, "
              f"+{(inner['on'] - inner['off']) * 1e3:.2f} ms in the magic; after/before = {through} (through the "
              f"kernel), {(inner['on'] - inner['off']) / (ref_inner['on'] - ref_inner['off']):.2f}x (in the magic)")
    if "ipyparallel" in lat:
        print(f"  trivial cell, ipyparallel %%px           {lat['ipyparallel'] * 1e3:8.2f} ms   "
              f"ours (on) / ipyparallel = {lat['on'] / lat['ipyparallel']:.2f}x")
    want = n * lines
    if args.json:
        figures = {"ranks": n, "lines_per_rank": lines, "trivial_s": lat, "trivial_in_magic_s": inner,
                   "reference_trivial_in_magic_s": ref_inner, "flood": floods, "paced_flood": paced}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
        print(f"  figures written to {args.json}")
    if args.trivial_only:
        return
    times = f", each {args.repeat} times (interleaved; medians of all their round trips)" if args.repeat > 1 else ""
    for title, runs in ((f"flood: {lines} lines per rank ({want} lines) as fast as they come{times}", floods),
                        (f"paced flood: the same lines in 20 bursts over ~2 s{times}", paced)):
        print(f"  {title}")
        for key, f in runs.items():
            lost = "none lost, in order" if f["lines"] == want and f["in_order"] else f"LOST {want - f['lines']}"
            extra = (f"; {f['updates']:.0f} dashboard updates, {f['bytes'] / 1024:.0f} KiB" if key.endswith("on")
                     else "")
            print(f"    {key:<12} {f['s']:7.2f} s  lines {f['lines']} ({lost}); control channel round trip "
                  f"median {f['control_median_s'] * 1e3:.1f} ms, max {f['control_max_s'] * 1e3:.1f} ms{extra}")
        print(f"    on/off time = {runs['on']['s'] / runs['off']['s']:.2f}x"
              + (f"; ours (on) / ipyparallel time = {runs['on']['s'] / runs['ipyparallel']['s']:.2f}x"
                 if "ipyparallel" in runs else "")
              + (f"; on: after/before = {runs['on']['s'] / runs['before:on']['s']:.2f}x"
                 if "before:on" in runs else ""))
    if "ipyparallel" in floods:
        peer = floods["ipyparallel"]["control_median_s"]
        goal = max(2 * peer, 0.004)
        for key in [k for k in ("on", "off", "before:on", "before:off") if k in floods]:
            ours = floods[key]["control_median_s"]
            print(f"  goal (issue 30): control round trip median during the flood <= 2x ipyparallel's "
                  f"({2 * peer * 1e3:.1f} ms) or <= 4 ms: {key} {ours * 1e3:.1f} ms = {ours / peer:.2f}x theirs: "
                  + ("met" if ours <= goal else "NOT met"))


if __name__ == "__main__":
    main()
