"""The confidence head's calibration (DSpark, model/families/dspark.py): its predicted acceptance per draft position
beside the acceptance greedy verification observed (decoding.py's proposer collects the predictions per cycle).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def confidence_calibration(
    confidences: Sequence[Sequence[Sequence[float]]], accept_lengths: Sequence[Sequence[int]]
) -> dict[str, float]:
    """Reliability of the confidence head per draft position k = 1..K, over the cycles that reached k (the k - 1
    drafts before it accepted): `eval/conf_pred_<k>` the mean predicted acceptance, `eval/conf_obs_<k>` the share
    accepted; `eval/conf_error` the mean |pred - obs| over reached positions (weighted by how often each was
    reached); `eval/conf_tau_pred` the mean over cycles of 1 + sum_k prod_{i<=k} c_i (the tau the head predicts)
    beside the observed tau. Empty without confidences."""
    pred: dict[int, list[float]] = {}
    hit: dict[int, list[float]] = {}
    tau_pred = []
    for prompt_conf, prompt_lengths in zip(confidences, accept_lengths):
        if len(prompt_conf) != len(prompt_lengths):
            raise ValueError(f"{len(prompt_conf)} cycles of confidences for {len(prompt_lengths)} accept lengths")
        for conf, length in zip(prompt_conf, prompt_lengths):
            accepted = length - 1
            for k, c in enumerate(conf, start=1):
                if k - 1 > accepted:
                    break
                pred.setdefault(k, []).append(c)
                hit.setdefault(k, []).append(1.0 if k <= accepted else 0.0)
            tau_pred.append(1.0 + sum(math.prod(conf[: k + 1]) for k in range(len(conf))))
    if not tau_pred:
        return {}
    out: dict[str, float] = {}
    weighted, reached = 0.0, 0
    for k in sorted(pred):
        p, o = sum(pred[k]) / len(pred[k]), sum(hit[k]) / len(hit[k])
        out[f"eval/conf_pred_{k}"], out[f"eval/conf_obs_{k}"] = p, o
        weighted += abs(p - o) * len(pred[k])
        reached += len(pred[k])
    out["eval/conf_error"] = weighted / reached
    out["eval/conf_tau_pred"] = sum(tau_pred) / len(tau_pred)
    return out
