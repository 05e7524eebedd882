"""Two runs of the same config at once never half-write a folder: one builds, the other
waits on the fingerprint's lock and then reuses the result."""

import multiprocessing as mp
from pathlib import Path

from conftest import tiny_config_dict, write_config


def _prepare(cfg_path: str, barrier, out) -> None:
    from stages.core.config import load_config
    from stages.pipeline import plan, run_stage
    p = plan(load_config(cfg_path))
    barrier.wait()
    lines = []
    r = run_stage(p, "prepare", on_line=lines.append)
    out.put((r.cached, r.path, lines))


def test_concurrent_runs_share_one_result(tmp_path):
    cfg_path = str(write_config(tmp_path, tiny_config_dict(tmp_path)))
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_prepare, args=(cfg_path, barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    results = sorted(out.get(timeout=5) for _ in procs)
    assert [cached for cached, _, _ in results] == [False, True]
    assert results[0][1] == results[1][1]
    # the one that waited said so (both started together; building takes seconds)
    assert any("another run is building" in line and "waiting" in line for line in results[1][2]), results[1][2]
    folder = Path(results[0][1])
    assert (folder / "manifest.json").is_file()
    assert not list(folder.parent.glob(".*.partial")), "no half-written folder may remain"
