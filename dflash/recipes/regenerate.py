"""`python -m dflash.regenerate IN OUT --backend hf|openai ...`: rewrite every assistant turn of a chat dataset
with the target, given the conversation so far (the paper's and every peer's recipe: the drafter learns the
target's own answers).

IN: JSONL or a .json array, as `data=jsonl` reads it (`messages`, ShareGPT `conversations`, normalised as for
training; `text` records are copied as they are; assistant turns before the first user turn are kept as they
are, as context). OUT: `{"messages": [...], "source_index": i}` per record, a file `data=jsonl` reads directly;
an answer cut at --max-new-tokens (not ended by the target) carries `"finish_reason": "length"`.
Resumable: records already in OUT are skipped, so a rerun after a crash (or after failures) does only the
rest; once every record is done, OUT is put in IN's order. Records are done in chunks, turn by turn across
the chunk (turn k of every record in one batch for `hf`, or concurrent requests for `openai`). A record that
cannot be regenerated (one training skips, with the same reason: empty, no user turn, ...; the template
rejects it; its request fails) is counted and listed in OUT.failures.jsonl with its reason, never fatal.
OUT.settings.json records who answered (the backend's target files or served model, and the generation
settings) and what: IN's path, size and content hash. A resume with another target, other settings or another
IN (other content: a file moved elsewhere is the same IN) is refused, naming each key and both values, so one
file never mixes two targets' answers or two inputs' records (a built target's config.json or
tokenizer_config.json rewritten in place by its builder, the build, weights and tokenizer the same, is the same
target: REWRITABLE_TARGET_FILES). OUT.cost.json says what the answers in OUT cost:
this process's CPU seconds and wall seconds while generating (summed over resumes, written after every chunk;
the openai backend's server's time is not in it) and how many answers they made.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash.core.disk import check_free
from dflash.data.chat import first_user, parse_line, record_messages
from dflash.data.corpus import BadRecordError
from dflash.data.records import iter_raw_records, read_error_reason
from dflash.recipes.regen_backends import ReplyFailed

log = logging.getLogger("dflash.regenerate")


@dataclass
class Outcome:
    total: int
    done_before: int
    completed: int
    failed: int
    out: Path
    failed_by_reason: dict


class SettingsMismatch(ValueError):
    """OUT holds answers made with other settings or from another input than these: refused, naming each key."""


def failures_path(out: Path) -> Path:
    return out.with_name(out.name + ".failures.jsonl")


def settings_path(out: Path) -> Path:
    return out.with_name(out.name + ".settings.json")


def cost_path(out: Path) -> Path:
    return out.with_name(out.name + ".cost.json")


def read_cost(out: Path) -> dict:
    """OUT's cost so far: {"cpu_s", "wall_s", "answers"} (zeros where none was recorded: answers made before
    costs were recorded are answers that no cost covers)."""
    from dflash.core.jsonio import read_json

    cost = read_json(cost_path(out), default=None)
    zero = {"cpu_s": 0.0, "wall_s": 0.0, "answers": 0}
    return {**zero, **cost} if isinstance(cost, dict) else zero


class CostMeter:
    """Adds this process's CPU and wall seconds since it was made, and the answers completed, to OUT.cost.json;
    a fresh OUT (no answer in it yet) starts a fresh account."""

    def __init__(self, out: Path, fresh: bool):
        self.out = out
        self.base = {"cpu_s": 0.0, "wall_s": 0.0, "answers": 0} if fresh else read_cost(out)
        self.cpu0, self.wall0 = time.process_time(), time.monotonic()

    def record(self, answers: int) -> None:
        cost = {
            "cpu_s": round(self.base["cpu_s"] + time.process_time() - self.cpu0, 3),
            "wall_s": round(self.base["wall_s"] + time.monotonic() - self.wall0, 3),
            "answers": self.base["answers"] + answers,
        }
        _atomic_write(cost_path(self.out), json.dumps(cost, indent=2).encode() + b"\n")


def input_identity(path: Path) -> dict:
    """What IN is: its path, size and content hash (sampled above 256 MiB, as the data fingerprint hashes)."""
    from dflash.data.fingerprint import file_hash

    path = Path(path)
    return {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": file_hash(path)}


# a built or converted target's JSON files that its builder may rewrite in place without changing what the target
# computes (model/gguf_target.py makes a cached conversion's config.json and tokenizer_config.json a plain
# checkpoint's: the same RoPE in both forms, a tokenizer class older readers know)
REWRITABLE_TARGET_FILES = frozenset({"config.json", "tokenizer_config.json", "generation_config.json"})


def _same(key: str, before, now) -> bool:
    if key == "input" and isinstance(before, dict) and isinstance(now, dict):  # the content decides, not where
        return {k: v for k, v in before.items() if k != "path"} == {k: v for k, v in now.items() if k != "path"}
    if key == "target_files" and isinstance(before, dict) and isinstance(now, dict):
        return _same_build(before, now)
    return before == now


def _same_build(before: dict, now: dict) -> bool:
    """The same target: every file hashes the same, or only its rewritable JSON files differ and it is the same
    build (build_info.json, which records what it was built or converted from) with the same weights and
    tokenizer. A target without build_info.json (a hub model, your folder) must match file for file."""
    if before == now:
        return True
    differ = {k for k in set(before) | set(now) if before.get(k) != now.get(k)}
    return "build_info.json" in before and differ <= REWRITABLE_TARGET_FILES


def _shown(key: str, value) -> str:
    if key == "input" and isinstance(value, dict):
        return f"{value.get('path')} ({value.get('bytes')} bytes, sha256 {str(value.get('sha256'))[-12:]})"
    return repr(value)


def check_same_settings(out: Path, settings: dict, done: int, inputs=None) -> None:
    """Refuse to add to OUT's `done` answers with other settings (or from another input) than they were made
    with; then record these. Another input is accepted when every answer in OUT asks what the new input's record of
    its source_index asks (`inputs`, as read_inputs gives them): e.g. an input grown by more records."""
    path = settings_path(out)
    if done and path.exists():
        before = json.loads(path.read_text())
        if "input" not in before:  # written before the input was recorded
            log.warning("%s: %s records no input (an older version wrote it): IN is not checked", out, path.name)
            before["input"] = settings.get("input")
        differ = [
            key for key in sorted(set(before) | set(settings)) if not _same(key, before.get(key), settings.get(key))
        ]
        if differ == ["input"] and inputs is not None and _answers_ask_the_same(out, inputs):
            log.info("%s: its %d answers ask what the new input's records ask: kept (the input grew)", out, done)
        elif differ:
            shown = [f"{k}: OUT {_shown(k, before.get(k))} vs now {_shown(k, settings.get(k))}" for k in differ]
            raise SettingsMismatch(
                f"{out} holds {done} answers made with other settings ({'; '.join(shown)}): "
                "remove it (and its .settings.json) or write to another OUT"
            )
        if before.get("target_files") != settings.get("target_files"):
            rewritten = sorted(
                k for k in settings["target_files"] if before["target_files"].get(k) != settings["target_files"][k]
            )
            log.warning(
                "%s: the target's %s changed since its %d answers were made, its build, weights and tokenizer did "
                "not (rewritten in place by its builder): the answers are kept", out, ", ".join(rewritten), done,
            )  # fmt: skip
    elif done:
        log.warning("%s: %d answers and no %s (an older version wrote it): resuming unchecked", out, done, path.name)
    _atomic_write(path, json.dumps(settings, indent=2, sort_keys=True).encode() + b"\n")


def _asked(messages) -> list[tuple[str, str]]:
    """What a conversation asks: its turns but the assistant's (the ones regeneration replaces)."""
    return [(m["role"], m["content"]) for m in messages if m["role"] != "assistant"]


def _answers_ask_the_same(out: Path, inputs) -> bool:
    for line in out.read_bytes().splitlines():
        if not line.strip():
            continue
        answer = json.loads(line)
        i = int(answer["source_index"])
        if i >= len(inputs) or inputs[i][1] is None:
            return False
        try:
            asked = record_messages(inputs[i][1], inputs[i][0])
        except BadRecordError:
            return False
        if asked is None or _asked(asked) != _asked(answer.get("messages", [])):
            return False
    return True


def read_inputs(path: Path) -> list[tuple[str, dict | None, str, str]]:
    """Every record of IN (a JSONL line or an element of a .json array) as (where, record or None, error, reason)."""
    rows = []
    for where, raw, read_error in iter_raw_records(path):
        try:
            if read_error:
                raise BadRecordError(read_error, read_error_reason(read_error))
            record = parse_line(raw, where)
            record_messages(record, where)  # validated now: a bad record fails alone, before any request
            rows.append((where, record, "", ""))
        except BadRecordError as e:
            rows.append((where, None, str(e), e.reason))
    return rows


def done_indices(out: Path) -> set[int]:
    """Source indices already in OUT. A torn last line (a crash mid-write) is cut off first."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    lines = data.split(b"\n")
    keep, done = [], set()
    for line in lines:
        if not line.strip():
            continue
        try:
            done.add(int(json.loads(line)["source_index"]))
            keep.append(line)
        except (ValueError, KeyError, TypeError):
            log.warning("OUT %s: dropping an incomplete line (a crash mid-write): %.60r", out, line)
    if len(keep) != sum(1 for line in lines if line.strip()):
        _atomic_write(out, b"".join(line + b"\n" for line in keep))
    return done


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def regenerate_record_turns(backend, records: list[dict]) -> list[dict | BaseException]:
    """New assistant turns for a chunk of records, turn k of all records in one backend call."""
    convs = [record_messages(r, "record") for r in records]
    results: list[dict | BaseException] = [None] * len(records)  # type: ignore[list-item]
    new = [[] if c is not None else None for c in convs]
    pos = [0] * len(records)
    for i, c in enumerate(convs):  # assistant turns before the first user turn answer nothing: kept as context
        if c is not None:
            new[i], pos[i] = list(c[: first_user(c)]), first_user(c)
    while True:
        asking = []  # records waiting for their next assistant turn
        for i, c in enumerate(convs):
            if c is None or isinstance(results[i], BaseException) or results[i] is not None:
                continue
            while pos[i] < len(c) and c[pos[i]]["role"] != "assistant":
                new[i].append(c[pos[i]])
                pos[i] += 1
            if pos[i] == len(c):
                results[i] = {"messages": new[i]}
            else:
                asking.append(i)
        if not asking:
            break
        try:
            replies = backend.complete([new[i] for i in asking])
        except Exception as e:  # noqa: BLE001 - a batch that fails as a whole fails its records, not the job
            replies = [e] * len(asking)
        for i, reply in zip(asking, replies):
            if isinstance(reply, BaseException):
                results[i] = reply
            else:
                # a reply cut at max_new_tokens says so: training leaves the end of turn the template adds unsupervised
                cut = {"finish_reason": "length"} if getattr(reply, "cut", False) else {}
                new[i].append({"role": "assistant", "content": str(reply), **cut})
                pos[i] += 1
    for i, r in enumerate(records):
        if convs[i] is None:  # a text record: nothing to regenerate
            results[i] = dict(r)
    return results


def regenerate_file(in_path: Path, out: Path, backend, chunk_size: int) -> Outcome:
    from dflash.core.terminal import display

    inputs = read_inputs(in_path)
    done = done_indices(out)
    todo = [i for i in range(len(inputs)) if i not in done]
    failures = [
        {"source_index": i, "where": inputs[i][0], "reason": inputs[i][3], "error": inputs[i][2]}
        for i in todo
        if inputs[i][1] is None
    ]
    todo = [i for i in todo if inputs[i][1] is not None]
    regenerable = len(done) + len(todo)
    completed, t0 = 0, time.monotonic()
    log.info("%s: %d records, %d already in %s, %d to do", in_path, len(inputs), len(done), out, len(todo))
    out.parent.mkdir(parents=True, exist_ok=True)
    # about the input's size again for what is left (the answers replace answers of a similar length)
    share = len(todo) / max(len(inputs), 1)
    check_free(out.parent, int(Path(in_path).stat().st_size * share), "the regenerated data")
    check_same_settings(out, {**backend.identity(), "input": input_identity(in_path)}, len(done), inputs)
    meter = CostMeter(out, fresh=not done)
    with open(out, "ab") as sink, display().phase("regenerate", len(todo)) as phase:
        for start in range(0, len(todo), chunk_size):
            chunk = todo[start : start + chunk_size]
            results = regenerate_record_turns(backend, [inputs[i][1] for i in chunk])
            lines = []
            for i, result in zip(chunk, results):
                if isinstance(result, BaseException):
                    failures.append(
                        {"source_index": i, "where": inputs[i][0], "reason": reason(result), "error": _describe(result)}
                    )
                else:
                    lines.append(json.dumps({**result, "source_index": i}, ensure_ascii=False).encode() + b"\n")
            sink.write(b"".join(lines))
            sink.flush()
            os.fsync(sink.fileno())  # a chunk is on disk before the next starts: a crash loses one chunk at most
            completed += len(lines)
            meter.record(completed)
            rate = (start + len(chunk)) / max(time.monotonic() - t0, 1e-9)
            phase.advance(len(chunk), info=f"{rate:.1f} records/s, {len(failures)} failed")
    _write_failures(out, failures)
    if len(done) + completed == regenerable:  # every record that can be regenerated is
        _sort_by_source(out)
    by_reason: dict[str, int] = {}
    for f in failures:
        by_reason[f["reason"]] = by_reason.get(f["reason"], 0) + 1
    return Outcome(len(inputs), len(done), completed, len(failures), out, by_reason)


def reason(error: BaseException) -> str:
    """What a failed record is counted under: a bad record's reason, or what the backend's failure was."""
    if isinstance(error, (BadRecordError, ReplyFailed)):  # by type: an error's text may say anything
        return error.reason
    return "request_failed"


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


def _write_failures(out: Path, failures: list[dict]) -> None:
    path = failures_path(out)
    if failures:
        _atomic_write(path, b"".join(json.dumps(f).encode() + b"\n" for f in failures))
    elif path.exists():
        path.unlink()  # all done: an old list would mislead


def _sort_by_source(out: Path) -> None:
    """OUT in IN's order once complete (retried records were appended at the end): runs train reproducibly."""
    lines = [line for line in out.read_bytes().split(b"\n") if line.strip()]
    keyed = sorted(lines, key=lambda line: json.loads(line)["source_index"])
    if keyed != lines:
        _atomic_write(out, b"".join(line + b"\n" for line in keyed))


def build_backend(args: argparse.Namespace):
    from dflash.recipes.regen_backends import GenerationSettings, HFBackend, OpenAIBackend

    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        thinking=args.thinking,
        seed=args.seed,
        template_kwargs=json.loads(args.chat_template_kwargs),
    )
    if args.backend == "hf":
        if not args.target:
            raise SystemExit("--backend hf needs --target (a model directory or hub id)")
        return HFBackend(args.target, settings, args.device, args.dtype)
    if not args.base_url:
        raise SystemExit("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
    return OpenAIBackend(args.base_url, settings, args.model, args.concurrency, args.max_retries, args.timeout_s)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.regenerate", description=__doc__.split("\n\n")[0])
    p.add_argument("input", type=Path, help="chat JSONL or .json array (messages or ShareGPT conversations)")
    p.add_argument("output", type=Path, help="regenerated JSONL (resumed when it exists)")
    p.add_argument("--backend", choices=("hf", "openai"), default="hf")
    p.add_argument("--target", help="hf: the target model (directory or hub id)")
    p.add_argument("--device", default="auto", help="hf: cuda, cuda:1, cpu or auto")
    p.add_argument(
        "--dtype",
        default="auto",
        help="hf: float32, bfloat16 or float16; auto = bfloat16, float32 on a CPU without fast bf16 kernels",
    )
    p.add_argument("--base-url", help="openai: the server's /v1 URL")
    p.add_argument("--model", help="openai: the served model's name (default: the first one the server lists)")
    p.add_argument("--concurrency", type=int, default=16, help="openai: requests in flight")
    p.add_argument("--max-retries", type=int, default=3, help="openai: retries per request, with backoff")
    p.add_argument("--timeout-s", type=float, default=600.0, help="openai: seconds per request")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (deterministic)")
    p.add_argument("--thinking", choices=("on", "off", "auto"), default="auto", help="Qwen3-style enable_thinking")
    p.add_argument("--chat-template-kwargs", default="{}", help="JSON, passed to the chat template")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=None, help="records per chunk (default: 64 hf, 8x concurrency)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from dflash.core.terminal import install_logging

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_logging()  # log lines scroll above the progress bar on a terminal
    if not args.input.is_file():
        raise SystemExit(f"{args.input}: no such file")
    from dflash.recipes.regen_backends import ServerUnreachable

    try:
        backend = build_backend(args)
    except ServerUnreachable as e:  # one line, not the client's three chained tracebacks
        raise SystemExit(f"error: {e}") from None
    chunk = args.chunk_size or (64 if args.backend == "hf" else 8 * args.concurrency)
    outcome = regenerate_file(args.input, args.output, backend, chunk)
    log.info(
        "regenerated %d records with %s (%d were done before, %d failed%s) -> %s",
        outcome.completed,
        backend.name,
        outcome.done_before,
        outcome.failed,
        f" {outcome.failed_by_reason}: see {failures_path(outcome.out)}; rerun the same command to retry them"
        if outcome.failed
        else "",
        outcome.out,
    )
    return 0
