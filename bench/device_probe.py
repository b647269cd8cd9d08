"""Where a GPU round's time goes on the lent machine: the host's cost per kernel launch, and one xl forward.

Run by ``bench/device_check.sh``. CUDA events time the stream, so a round's "device time" includes the GPU
waiting for the host to enqueue work; this probe separates the two with a plain launch loop and a CUDA graph.
"""

from __future__ import annotations

import json
import time

import torch


def _wall(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main() -> int:
    from engine.loader import load_models

    res: dict[str, float] = {"torch_threads": torch.get_num_threads()}
    x = torch.zeros(16, device="cuda")
    res["launch_us"] = _wall(lambda: x.add_(1.0), 2000) * 1e6

    def one_sync() -> None:
        x.add_(1.0)
        torch.cuda.synchronize()

    def one_item() -> None:  # the engine's round ends in one such read (accepted counts to the host)
        x.add_(1.0)
        x[:4].tolist()

    res["launch_and_sync_us"] = _wall(one_sync, 200) * 1e6
    res["launch_and_tolist_us"] = _wall(one_item, 200) * 1e6
    host = torch.arange(64)
    res["h2d_pageable_copy_us"] = _wall(lambda: host.to("cuda"), 200) * 1e6
    models = load_models(device="cuda", with_update=False, profile="xl")
    tok = torch.tensor([[256, 100]], device="cuda")
    with torch.no_grad():
        res["xl_forward_ms"] = _wall(lambda: models.target(tok), 20) * 1e3
        res["draft_forward_ms"] = _wall(lambda: models.draft(tok), 20) * 1e3
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            models.target(tok)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            models.target(tok)
        res["xl_forward_graph_ms"] = _wall(g.replay, 20) * 1e3
    torch.set_num_threads(1)
    res["launch_us_1thread"] = _wall(lambda: x.add_(1.0), 2000) * 1e6
    with torch.no_grad():
        res["xl_forward_ms_1thread"] = _wall(lambda: models.target(tok), 20) * 1e3
    print(json.dumps({k: round(v, 3) for k, v in res.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
