"""Replay a telemetry store into the goodput policy's cost model: predicted seconds per step against measured.

``python -m bench.cost_replay STORE_URL [--k-max 5] [--speed-memory 3 0]`` replays every stored window, oldest
first, into a fresh :class:`~policies.goodput.GoodputPolicy` with vLLM's settings (``VLLM_POLICY``), once per
``--speed-memory`` value, and prints, per cost cell (batch bucket, context bucket), what the policy's cost model
predicts a step to take at each k beside what the cell's windows measured (draft + verify + other seconds over
rounds). It is how the speed normalisation's walk was found on ``bench vllm``'s telemetry
(``bench/results/vllm-35545ee-run1-telemetry.sqlite.gz``, gunzip it first; ``GoodputPolicy``'s
``cost_speed_memory`` has the figures).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from controller.service.build import VLLM_POLICY
from policies.goodput import GoodputPolicy
from telemetry.records import AcceptanceWindow, CostWindow
from telemetry.store import Store


def load(store_url: str) -> list[AcceptanceWindow | CostWindow]:
    """Every stored window, in the order they closed."""
    with Store(store_url) as st:
        acc, cost = st.recent_windows(10**9)
    windows: list[tuple[float, AcceptanceWindow | CostWindow]] = [(w.window_end, w.window) for w in acc]
    windows += [(w.window_end, w.window) for w in cost]
    windows.sort(key=lambda x: x[0])
    return [w for _, w in windows]


def replay(windows: Sequence[AcceptanceWindow | CostWindow], k_max: int, speed_memory: int) -> GoodputPolicy:
    """A fresh vLLM goodput policy fed ``windows`` in order."""
    policy = GoodputPolicy(k_max=k_max, seed=0, **(dict(VLLM_POLICY) | {"cost_speed_memory": speed_memory}))
    for w in windows:
        policy.observe(w)
    return policy


def table(policy: GoodputPolicy, cost: Sequence[CostWindow], k_max: int) -> list[dict[str, Any]]:
    """Per cost cell: the mean batch, predicted ms per step at each k, measured ms per step and rounds at each k."""
    measured: dict[tuple[int, str, int], list[float]] = {}
    for w in cost:
        m = measured.setdefault((w.batch_bucket, w.context_bucket, w.max_k), [0.0, 0.0])
        m[0] += w.rounds
        m[1] += w.draft_s.total + w.verify_s.total + w.other_s.total
    cm = policy._cost
    out = []
    for bb, ctx in sorted({(b, c) for b, c, _ in measured}, key=lambda x: (x[0], x[1])):
        b = cm.mean_batch(bb, ctx)
        pred = cm.predict(bb, ctx, b, None).sum(axis=1)
        here = {k: measured[(bb, ctx, k)] for k in range(k_max + 1) if measured.get((bb, ctx, k), [0.0])[0] > 0}
        out.append({"batch_bucket": bb, "context": ctx, "mean_batch": b,
                    "predicted_ms": [1e3 * float(s) for s in pred],
                    "measured_ms": {k: 1e3 * secs / rounds for k, (rounds, secs) in here.items()},
                    "rounds": {k: int(rounds) for k, (rounds, _) in here.items()}})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cost_replay", description=__doc__.splitlines()[0])
    ap.add_argument("store_url", help="a telemetry store, e.g. sqlite:///telemetry.sqlite")
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--speed-memory", type=int, nargs="+", default=[3, 0])
    a = ap.parse_args(argv)
    windows = load(a.store_url)  # read once, replayed once per setting
    cost = [w for w in windows if isinstance(w, CostWindow)]
    for sm in a.speed_memory:
        policy = replay(windows, a.k_max, sm)
        print(f"speed_memory={sm}: {len(cost)} cost windows; predicted ms per step by k | measured ms (rounds)")
        for row in table(policy, cost, a.k_max):
            meas = " ".join(f"{k}:{v:.0f}({row['rounds'][k]})" for k, v in row["measured_ms"].items())
            pred = " ".join(f"{v:6.1f}" for v in row["predicted_ms"])
            print(f"  {row['batch_bucket']:3} {row['context']:7} b={row['mean_batch']:5.1f} {pred} | {meas}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
