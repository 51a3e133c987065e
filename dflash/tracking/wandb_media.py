"""W&B charts and tables built on the W&B logger's worker thread from queued plain-data records: the final
eval's (acceptance histogram, per-position acceptance, samples) and the benchmark suites' (a row per suite and
temperature, and a bar chart of their tau)."""

from __future__ import annotations

from dflash.core.rundir import BENCH_COLUMNS

MEDIA = "__media__"  # the key of a queued record that build_media turns into W&B objects

BENCH_TABLE_COLUMNS = ("suite", "temperature", *BENCH_COLUMNS)


def bench_rows(data: dict) -> list[list]:
    """benchmarks.json's results as table rows (suite, temperature, then BENCH_COLUMNS; None where absent).
    Only the metrics travel: the per-generation token ids stay in benchmarks.json."""
    rows = []
    for r in (data.get("results") or {}).values():
        s, m = r["settings"], r["metrics"]
        rows.append([s["suite"], float(s["temperature"]), *(m.get(k) for k in BENCH_COLUMNS)])
    return rows


def build_media(payload: dict) -> dict:
    """The dict to `run.log` for a queued media record (`kind`: final_eval | benchmarks)."""
    return {"final_eval": _final_eval, "benchmarks": _benchmarks}[payload["kind"]](payload)


def _benchmarks(payload: dict) -> dict:
    import wandb

    table = wandb.Table(columns=list(BENCH_TABLE_COLUMNS), data=payload["rows"])
    tau = wandb.Table(
        columns=["suite @ temperature", "tau"],
        data=[[f"{r[0]} @ T={r[1]:g}", r[2]] for r in payload["rows"] if r[2] is not None],
    )
    return {
        "step": payload["step"],
        "bench/table": table,
        "bench/tau_by_suite": wandb.plot.bar(tau, "suite @ temperature", "tau", title="tau per benchmark suite"),
    }


def _final_eval(payload: dict) -> dict:
    import wandb

    metrics, details = payload["metrics"], payload["details"]
    hist = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in metrics.items() if k.startswith("eval/acc_hist_"))
    pos = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in metrics.items() if k.startswith("eval/acc_pos_"))
    hist_table = wandb.Table(columns=["accepted tokens", "share of cycles"], data=[[k, v] for k, v in hist])
    pos_table = wandb.Table(columns=["draft position", "acceptance"], data=[[k, v] for k, v in pos])
    rows = details.get("prompts", [])
    samples = wandb.Table(
        columns=["prompt", "output", "accept_lengths", "tau"],
        data=[
            [
                r.get("prompt_text", ""),
                r.get("output_text", ""),
                str(r.get("accept_lengths", [])),
                sum(r.get("accept_lengths", [])) / max(1, len(r.get("accept_lengths", []))),
            ]
            for r in rows
        ],
    )
    return {
        "step": payload["step"],
        "eval/accept_length_hist": wandb.plot.bar(
            hist_table, "accepted tokens", "share of cycles", title="Acceptance length per verify cycle"
        ),
        "eval/accept_by_position": wandb.plot.bar(
            pos_table, "draft position", "acceptance", title="Acceptance by draft position"
        ),
        "eval/samples": samples,
    }
