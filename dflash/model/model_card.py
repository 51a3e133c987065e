"""The exported drafter's model card: `drafter/README.md`, with the YAML front matter Hugging Face model repositories
read (base_model, library_name, license, tags), stating what the drafter is evidence of: its target, data, recipe,
tau per suite beside prompt lookup's (with 95% intervals where measured), the machine, and the commands that serve
it. Everything comes from the run directory (config_resolved.yaml, run.json, summary.json, eval.json,
benchmarks.json), so `python -m dflash.export RUN_DIR OUT` writes the same card as the run's own export.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash.core.jsonio import write_text_atomic
from dflash.core.rundir import RUN_INFO_FILE, load_run

CARD_FILE = "README.md"
TAGS = ("speculative-decoding", "dflash", "block-diffusion", "draft-model", "dflash-train")


def _fmt(value, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "-"


def _interval(m: dict, prefix: str) -> str:
    lo, hi = m.get(f"{prefix}_ci95_low"), m.get(f"{prefix}_ci95_high")
    return f"[{_fmt(lo)}, {_fmt(hi)}]" if isinstance(lo, int | float) and isinstance(hi, int | float) else ""


def _count(value) -> str:
    return str(int(value)) if isinstance(value, int | float) else ""


def tau_rows(metrics: dict) -> list[list[str]]:
    """One row per measured set of prompts: held-out (eval/*) and each suite at temperature 0 (bench/<suite>/*)."""
    rows = []
    if "eval/tau" in metrics:
        diff = metrics.get("eval/tau_minus_lookup")
        rows.append(
            ["held-out", _fmt(metrics["eval/tau"]), _interval(metrics, "eval/tau"),
             _fmt(metrics.get("eval/tau_baseline")), _fmt(diff) + " " + _interval(metrics, "eval/tau_minus_lookup"),
             _count(metrics.get("eval/num_prompts"))]
        )  # fmt: skip
    suites = sorted({k.split("/")[1] for k in metrics if k.startswith("bench/") and k.count("/") == 2})
    for s in suites:
        p = f"bench/{s}"
        if f"{p}/tau" not in metrics:
            continue
        rows.append(
            [s, _fmt(metrics[f"{p}/tau"]), _interval(metrics, f"{p}/tau"), _fmt(metrics.get(f"{p}/tau_lookup")),
             _fmt(metrics.get(f"{p}/tau_minus_lookup")) + " " + _interval(metrics, f"{p}/tau_minus_lookup"),
             _count(metrics.get(f"{p}/num_prompts"))]
        )  # fmt: skip
    return rows


def _machine(info: dict) -> str:
    device = info.get("device") or {}
    gpus = device.get("gpus")
    where = ", ".join(gpus) if gpus else f"CPU: {device.get('cpu', 'unknown')} ({device.get('cpu_count', '?')} cores)"
    torch_version = (info.get("packages") or {}).get("torch", "?")
    return f"{where}; torch {torch_version}"


def _commit(git: dict) -> str:
    if not git.get("sha"):
        return ""
    return f" at commit {git['sha'][:12]}" + (" (with local changes)" if git.get("dirty") else "")


def _fallback(info: dict) -> str:
    """Why bf16-mixed ran as fp32 (run.json's latest `precision` record), or nothing."""
    records = [p.get("precision") for p in [info, *(info.get("resumes") or [])] if isinstance(p, dict)]
    last = next((r for r in reversed(records) if isinstance(r, dict)), {})
    return f" (fell back: {last['fallback']})" if last.get("fallback") else ""


def _rendering(c: dict) -> str:
    """The chat rendering the drafter was trained on (data.chat_template_kwargs): serve it in the same."""
    prefix = "data.chat_template_kwargs."
    kwargs = {k[len(prefix) :]: v for k, v in c.items() if k.startswith(prefix)}
    if not kwargs and c.get("data.name") != "jsonl":
        return ""
    said = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in sorted(kwargs.items()))
    shown = f"`data.chat_template_kwargs={{{said}}}`" if kwargs else "the chat template's defaults"
    return f"; chats rendered with {shown}: serve with the same (e.g. thinking on or off)"


def _resume_changes(info: dict) -> str:
    """The loss and precision keys a resume changed, from the step it resumed at (run.json's `resumes`)."""
    said = []
    for r in info.get("resumes") or []:
        if isinstance(r, dict) and r.get("changed"):
            keys = ", ".join(f"`{k}` {v.get('from')} -> {v.get('to')}" for k, v in r["changed"].items())
            said.append(f"resumed at step {r.get('from_step', '?')} with {keys}")
    return "; " + "; ".join(said) if said else ""


def _draft_vocab(info: dict) -> str:
    """model.draft_vocab_size: the head's size and its coverage of the training labels (run.json's draft_vocab)."""
    dv = info.get("draft_vocab")
    if not dv:
        return ""
    counted = dv.get("counted", "the text's supervised tokens")  # runs before the choice counted the text
    return (
        f"; a draft vocabulary of {dv['size']:,} of the target's {dv['target_vocab_size']:,} tokens "
        f"(`model.draft_vocab_size`, vLLM speculators' `t2d`/`d2t` maps; in speculators' layout), covering "
        f"{100 * dv['coverage']:.2f}% of the {dv['labels_counted']:,} training labels counted ({counted})"
    )


def model_card(run_dir: str | Path) -> str:
    """The card's text for the run directory's drafter."""
    run = load_run(run_dir)
    c, m = run.config, run.metrics
    try:
        info = json.loads((Path(run_dir) / RUN_INFO_FILE).read_text())
    except (OSError, ValueError):
        info = {}
    target = c.get("model.target", "?")
    base = c.get("model.base_model") or target
    block = c.get("model.block_size", "?")
    family = c.get("drafter.name", "dflash")
    git = info.get("git") or {}
    front = [
        "---",
        f"base_model: {base}",
        "library_name: transformers",
        f"license: {c.get('model.license') or 'other'}",
        "pipeline_tag: text-generation",
        "tags:",
        *[f"- {t}" for t in TAGS],
        "---",
    ]
    recipe = (
        f"`drafter={family}` (z-lab's DFlash layout{'' if family == 'dflash' else ' plus its family heads'}), "
        f"{c.get('model.num_draft_layers', '?')} layers over target layers {c.get('model.target_layer_ids', '?')}, "
        f"block size {block}; `loss={c.get('loss.name', '?')}` `loss.labels={c.get('loss.labels', 'data')}`, "
        f"`optim={c.get('optim.name', '?')}` at `schedule.lr={c.get('schedule.lr', '?')}` "
        f"({c.get('schedule.name', '?')}), `train.precision={c.get('train.precision', 'fp32')}`{_fallback(info)}, "
        f"{m.get('step', '?')} steps of "
        f"{c.get('train.batch_size', '?')} x {c.get('train.seq_len', '?')} tokens with "
        f"{c.get('train.num_anchors', '?')} anchors a row, seed {c.get('train.seed', '?')}"
    )
    recipe += _resume_changes(info) + _draft_vocab(info)
    rows = tau_rows(m)
    table = [
        "| prompts | tau | 95% interval | prompt lookup | tau - lookup (paired, 95%) | n |",
        "|---|---:|---:|---:|---:|---:|",
        *["| " + " | ".join(r) + " |" for r in rows],
    ]
    speculative = int(block) - 1 if isinstance(block, int) else "B - 1"
    body = [
        f"# DFlash drafter for {base}",
        "",
        f"A block-diffusion drafter ([DFlash](https://arxiv.org/abs/2602.06036)) for speculative decoding with {base}: "
        f"it reads the target's hidden states and proposes {speculative} tokens a step, which the target verifies "
        "(greedy verification is lossless). Trained with dflash-train"
        + (
            f" at commit {git['sha'][:12]}{' (with local changes)' if git.get('dirty') else ''}"
            if git.get("sha")
            else ""
        )
        + ".",
        "",
        "## How it was made",
        "",
        f"- **Target**: `{target}`" + (f" (`{base}`)" if base != target else ""),
        f"- **Data**: `data={c.get('data.name', '?')}` `{c.get('data.path') or 'the embedded corpus'}`; "
        f"{m.get('tokens', '?')} target tokens seen in training"
        + (f", {m['train/supervised_tokens']} of them supervised" if "train/supervised_tokens" in m else "")
        + _rendering(c),
        f"- **Recipe**: {recipe}",
        f"- **Machine**: {_machine(info)}; {_fmt(m.get('wall_time_s'), 0)} s of wall time, status "
        f"`{m.get('status', run.status)}`",
        "",
        "## Acceptance length (tau)",
        "",
        "Accepted tokens per verify cycle under greedy decoding (held-out: pooled over cycles; suites: z-lab's mean "
        "over generations), prompt lookup on the same prompts beside it; intervals by a bootstrap over prompts.",
        "",
        *(table if rows else ["Not evaluated (`python -m dflash.evaluate RUN_DIR` measures it)."]),
        "",
        "## Serve it",
        "",
        "z-lab's layout: `config.json`, `model.safetensors` (no embedding or LM head: the target's are used) and "
        "`dflash.py`.",
        "",
        "```python",
        "from transformers import AutoModel",
        "",
        'drafter = AutoModel.from_pretrained("PATH/TO/THIS/FOLDER", trust_remote_code=True)  # z-lab\'s loop',
        "```",
        "",
        "```bash",
        f"python -m sglang.launch_server --model {base} --speculative-algorithm DFLASH \\",
        f"    --speculative-draft-model-path PATH/TO/THIS/FOLDER --speculative-num-draft-tokens {block}",
        f'vllm serve {base} --speculative-config \'{{"method": "dflash", "model": "PATH/TO/THIS/FOLDER", '
        f'"num_speculative_tokens": {speculative}}}\'',
        "```",
        "",
    ]
    if info.get("draft_vocab"):
        body += [
            "With its draft vocabulary it is exported in vLLM speculators' layout (z-lab's has no head of its own): "
            "load it with speculators' classes or dflash-train (`dflash.model.export.load_drafter`).",
            "",
        ]
    elif family != "dflash":
        body += [
            f"The `{family}` family adds heads to the DFlash backbone: load it with dflash-train "
            "(`dflash.model.export.load_drafter`) or with vLLM speculators' classes, as docs/evaluation.md says.",
            "",
        ]
    return "\n".join(front + body)


def write_model_card(run_dir: str | Path, drafter_dir: str | Path) -> Path:
    path = Path(drafter_dir) / CARD_FILE
    write_text_atomic(path, model_card(run_dir))
    return path
