"""Who writes the new assistant turns: the target in this process (`hf`) or any OpenAI-compatible server
(`openai`: vLLM, SGLang, `transformers serve`). A backend maps a batch of conversations (each ending before
an assistant turn) to a reply per conversation, or the exception that request ended with. A reply cut at
max_new_tokens (the target did not end its turn) is a `Reply` with `cut` set."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from dflash.data.chat import plain

log = logging.getLogger(__name__)


class ReplyFailed(ValueError):
    """A record's reply that a backend refuses, with the reason it is counted under (regenerate.reason)."""

    reason = "request_failed"


class TemplateRejects(ReplyFailed):
    reason = "template_rejects"


class EmptyReply(ReplyFailed):
    reason = "empty_reply"


class Reply(str):
    """A reply's text; `cut`: generation stopped at max_new_tokens, not at the target's end of turn."""

    cut: bool = False

    def __new__(cls, text: str, cut: bool = False):
        reply = super().__new__(cls, text)
        reply.cut = cut
        return reply


class ServerUnreachable(RuntimeError):
    """The openai backend's server does not answer at all: the message names the URL and says to start it."""


@dataclass
class GenerationSettings:
    max_new_tokens: int = 512
    temperature: float = 0.0
    thinking: str = "auto"  # on | off | auto (the template's default): Qwen3-style `enable_thinking`
    seed: int = 0
    template_kwargs: dict = field(default_factory=dict)

    def chat_template_kwargs(self) -> dict:
        kwargs = dict(self.template_kwargs)
        if self.thinking != "auto":
            kwargs["enable_thinking"] = self.thinking == "on"
        return kwargs


def generation_dtype(dtype: str, device_type: str, cpu_flags: set[str] | None = None) -> str:
    """auto: bfloat16, but float32 on a CPU without fast bfloat16 kernels (there bf16 is many times slower);
    a 16-bit dtype asked for on such a CPU is used as asked, with a warning."""
    from dflash.core.machine import slow_cpu_dtype

    if dtype == "auto":
        return "float32" if device_type == "cpu" and slow_cpu_dtype("bfloat16", cpu_flags) else "bfloat16"
    if device_type == "cpu" and (why := slow_cpu_dtype(dtype, cpu_flags)):
        log.warning("--dtype %s: %s", dtype, why.split(": ", 1)[-1])
    return dtype


class HFBackend:
    """Batched `generate` with the target on any device; conversations rendered by its chat template."""

    def __init__(self, target: str, settings: GenerationSettings, device: str = "auto", dtype: str = "auto"):
        import torch
        from transformers import AutoTokenizer

        from dflash.core.distributed import resolve_device
        from dflash.data.chat import end_of_turn_marker
        from dflash.model.target import load_causal_lm

        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(target)
        dev = resolve_device(device)
        dtype = getattr(torch, generation_dtype(dtype, dev.type))
        self.model = load_causal_lm(target, dtype).to(dev).eval()
        eot = end_of_turn_marker(self.tokenizer, **settings.chat_template_kwargs())
        eot_id = self.tokenizer.convert_tokens_to_ids(eot) if eot else None
        self.stop_ids = [i for i in (eot_id, self.tokenizer.eos_token_id) if isinstance(i, int) and i >= 0]
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.name, self.dtype = target, str(dtype).removeprefix("torch.")

    def identity(self) -> dict:
        """Who answers: the target's files (hashed, as the feature store's manifest hashes them) and settings."""
        from dflash.data.fingerprint import TOKENIZER_FILES, target_hashes

        # build_info.json: an embedded target rebuilt with other settings at the same path
        files = target_hashes(self.name, ("build_info.json", *TOKENIZER_FILES))
        return {"backend": "hf", "target": self.name, "target_files": files,
                "dtype": self.dtype, **asdict(self.settings)}  # fmt: skip

    def complete(self, conversations: list[list[dict]]) -> list[str | BaseException]:
        import torch

        from dflash.data.generate import generate_continuations

        s = self.settings
        replies: list[str | BaseException] = [ValueError("not generated")] * len(conversations)
        ids, asked = [], []
        for i, c in enumerate(conversations):
            try:
                prompt = self.tokenizer.apply_chat_template(
                    plain(c), tokenize=False, add_generation_prompt=True, **s.chat_template_kwargs()
                )
            except Exception as e:  # noqa: BLE001 - the template rejects this conversation: its failure alone
                replies[i] = TemplateRejects(f"the chat template rejects the conversation ({e})")
                continue
            ids.append(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            asked.append(i)
        if not ids:
            return replies
        torch.manual_seed(s.seed)
        outs = generate_continuations(self.model, ids, s.max_new_tokens, s.temperature, self.stop_ids, self.pad_id)
        for i, out in zip(asked, outs):
            ended = bool(out) and out[-1] in self.stop_ids
            if ended:
                out = out[:-1]  # the end-of-turn token is the template's, not the content's
            text = self.tokenizer.decode(out, skip_special_tokens=False)
            replies[i] = Reply(text, cut=not ended) if text.strip() else EmptyReply("the target's reply is empty")
        return replies


class OpenAIBackend:
    """Concurrent chat-completion requests; the client retries connection errors, 429 and 5xx with backoff."""

    def __init__(
        self,
        base_url: str,
        settings: GenerationSettings,
        model: str | None = None,
        concurrency: int = 16,
        max_retries: int = 3,
        timeout_s: float = 600.0,
    ):
        from openai import OpenAI

        self.settings = settings
        self.client = OpenAI(
            base_url=base_url,
            api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
            max_retries=max_retries,
            timeout=timeout_s,
        )
        self.name = self._served_model(model)  # one request before any record: a server that is not there
        self.concurrency = concurrency

    def identity(self) -> dict:
        """Who answers: the served model's name (not the URL: a restarted server may move) and the settings."""
        return {"backend": "openai", "model": self.name, **asdict(self.settings)}

    def _served_model(self, model: str | None) -> str:
        """`model`, or the first one the server lists; the listing also finds out whether a server answers."""
        from openai import APIConnectionError, APITimeoutError

        try:
            models = [m.id for m in self.client.models.list()]
        except (APIConnectionError, APITimeoutError) as e:  # after the client's retries
            raise ServerUnreachable(
                f"no OpenAI-compatible server answers at --base-url {self.client.base_url} ({e.__cause__ or e}): "
                "start the server first (e.g. vllm serve MODEL --port 8000), or pass its URL with --base-url"
            ) from None
        if model:
            return model
        if not models:
            raise RuntimeError(f"{self.client.base_url} serves no model; pass --model")
        return models[0]

    def _one(self, conversation: list[dict]) -> str:
        s = self.settings
        extra = {"chat_template_kwargs": s.chat_template_kwargs()} if s.chat_template_kwargs() else None
        response = self.client.chat.completions.create(
            model=self.name,
            messages=plain(conversation),
            max_tokens=s.max_new_tokens,
            temperature=s.temperature,
            seed=s.seed,
            extra_body=extra,
        )
        choice = response.choices[0]
        message = choice.message
        content = message.content or ""
        reasoning = getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning_content")
        if reasoning:  # servers with a reasoning parser return the think block apart from the answer
            content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
        if not content.strip():
            raise EmptyReply("the server returned an empty reply")
        return Reply(content, cut=choice.finish_reason == "length")

    def complete(self, conversations: list[list[dict]]) -> list[str | BaseException]:
        def safe(c):
            try:
                return self._one(c)
            except Exception as e:  # noqa: BLE001 - one request's failure is that record's, not the job's
                return e

        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(safe, conversations))
