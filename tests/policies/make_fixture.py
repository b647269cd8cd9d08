"""Writes ``fixture_engine.json``: a TEST FIXTURE in the engine benchmark's format, NOT a measurement.

Synthetic numbers shaped like a small draft/target pair on one GPU: verify cost flat in k at batch 1 and growing
with batch * (k + 1) at high batch; long contexts add KV-read cost; acceptance per request type, lower at long
context; target-v2 changes acceptance (code drops, prose and structured rise). Run:
``python tests/policies/make_fixture.py`` (deterministic).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

K = 8
ALPHA_V1 = {"code": 0.82, "prose": 0.6, "structured": 0.72}
ALPHA_V2 = {"code": 0.6, "prose": 0.74, "structured": 0.86}
CTX = {"short": 256, "long": 4096}
LONG_PENALTY = 0.07  # acceptance drops at long context
ROWS_MEASURED = 4000  # rows behind each histogram


def hist(alpha: float, k: int, rng: np.random.Generator) -> list[int]:
    p = np.array([alpha * 0.985**i for i in range(k)])  # conditional acceptance, slightly decaying with position
    surv = np.concatenate([[1.0], np.cumprod(p)])
    pmf = surv - np.concatenate([surv[1:], [0.0]])
    return [int(x) for x in rng.multinomial(ROWS_MEASURED, pmf / pmf.sum())]


def round_s(b: int, ctx: int, k: int) -> dict[str, float]:
    verify = 0.018 + 2.8e-4 * b * (k + 1) + 8e-8 * b * ctx * (1 + 0.3 * k)
    draft = k * (0.0022 + 8e-5 * b + 1e-8 * b * ctx)
    other = 0.0015 + 3e-5 * b
    return {"draft": round(draft, 7), "verify": round(verify, 7), "other": round(other, 7)}


def main() -> None:
    rng = np.random.default_rng(1234)
    cells = []
    for rtype, a in ALPHA_V1.items():
        for b in (1, 4, 16, 64):
            for cname, clen in CTX.items():
                alpha = a - (LONG_PENALTY if cname == "long" else 0.0)
                hists = {str(k): hist(alpha, k, rng) for k in range(1, K + 1)}
                rs = {str(k): round_s(b, clen, k) for k in range(0, K + 1)}
                mal = {k: float(np.dot(np.arange(len(h)), h) / sum(h) + 1) for k, h in hists.items()}
                plain = b / sum(rs["0"].values())
                spec = {k: b * mal[k] / sum(rs[k].values()) for k in hists}
                best = max(spec, key=lambda kk: spec[kk])
                cells.append({
                    "mode": "sample", "request_type": rtype, "batch_size": b, "context": cname, "context_len": clen,
                    "plain_tok_s": round(plain, 3), "spec_tok_s": {k: round(v, 3) for k, v in spec.items()},
                    "mean_accept_len": {k: round(v, 4) for k, v in mal.items()}, "accept_hist": hists,
                    "round_s": rs, "best_k": int(best) if spec[best] > plain else 0,
                    "best_speedup": round(max(spec[best] / plain, 1.0), 4),
                })
    v2 = {rtype: {str(k): hist(a, k, rng) for k in range(1, K + 1)} for rtype, a in ALPHA_V2.items()}
    out = {"device": "TEST FIXTURE (synthetic numbers, not a measurement)", "cells": cells,
           "version_acceptance": {"target-v2": v2}}
    Path(__file__).with_name("fixture_engine.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
