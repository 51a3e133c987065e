"""The drafter's optimizer, chosen by the `optim` group: `adamw` (one AdamW over every trainable parameter) or `muon`
(torch.optim.Muon over the hidden weight matrices, AdamW over the rest), behind one `DrafterOptimizer` that the
trainer steps, the schedule sets the learning rate of, and the checkpoints save and load.

Which parameters Muon takes: Muon orthogonalises the update of a weight matrix that maps one hidden space to another;
torch.optim.Muon accepts only 2-D parameters, and its docstring (after Keller Jordan's write-up) keeps embeddings, the
output layer, norms and biases on AdamW. The rule goes by a parameter's role, which the module owning it declares
(dflash/model/muon_split.py), not by its rank: the DFlash drafter has no trainable embedding or LM head (both are the
target's, frozen), but the families have tables over the vocabulary (DSpark's Markov head: `markov_w1` an embedding,
`markov_w2` a projection onto the vocabulary; DFlash2's two token codebooks) and DSpark's confidence head is an output
layer: all AdamW's. AdamW updates entry by entry, so a table's row that no batch looked up stays as it is (at the
default optim.weight_decay 0); Muon's orthogonalised update mixes every row into every other, and muon_weight_decay
shrinks them all. What Muon takes are the attention and MLP projections, the families' hidden projections and `fc`,
which projects the target's concatenated hidden states (dense features, not a token lookup) into the drafter's hidden
size: a hidden layer in Muon's sense, and speculators' Muon split (its RFC #979 defaults) puts it on Muon too. RMSNorm
weights, biases and DFlash2's convolution kernels go to AdamW. `optim.muon_exclude` moves named matrices (e.g. `[fc]`)
to AdamW, to measure the other choice. The plan applies the same rule to size the optimizer state.

Checkpoints: `adamw` saves AdamW's own state_dict (the format of every earlier checkpoint); `muon` saves
{"muon": ..., "adamw": ...}. Sharded (DCP) checkpoints pass `parts` to torch.distributed.checkpoint, which keys
both optimizers' state by parameter name.
"""

from __future__ import annotations

import logging

import torch

from dflash.core.config import ConfigError
from dflash.model.muon_split import split_for_muon
from dflash.train.muon import Muon, choose_ns_dtype

log = logging.getLogger(__name__)


class DrafterOptimizer:
    """One or two torch optimizers stepped together. `parts` maps a part's name to its optimizer."""

    def __init__(self, model: torch.nn.Module, optim_cfg, lr: float):
        self.cfg = optim_cfg
        self.name = optim_cfg.name
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if self.name == "adamw":
            self.parts = {"adamw": self._adamw([p for _, p in named], lr)}
        elif self.name == "muon":
            muon, adamw = split_for_muon(model, tuple(optim_cfg.muon_exclude))
            if not muon:
                raise ConfigError("optim=muon found no 2-D weight matrix to optimize (optim.muon_exclude took all)")
            device = muon[0].device
            self.ns_dtype, self.ns_dtype_reason = choose_ns_dtype(optim_cfg.get("muon_ns_dtype", "auto"), device)
            self.parts = {
                "muon": Muon(
                    muon,
                    ns_dtype=self.ns_dtype,
                    lr=lr * optim_cfg.muon_lr_ratio,
                    weight_decay=optim_cfg.muon_weight_decay,
                    momentum=optim_cfg.muon_momentum,
                    ns_steps=optim_cfg.muon_ns_steps,
                    adjust_lr_fn=optim_cfg.muon_adjust_lr,
                )
            }
            if adamw:
                self.parts["adamw"] = self._adamw(adamw, lr)
            log.info(
                "optim=muon: %d matrices by Muon (Newton-Schulz in %s: %s), %d other parameters by AdamW",
                len(muon),
                self.ns_dtype,
                self.ns_dtype_reason,
                len(adamw),
            )
        else:
            raise ConfigError(f"optim={self.name!r} is invalid: must be one of adamw, muon")

    def describe(self) -> dict:
        """What run.json records of the optimizer: its name and, under muon, the Newton-Schulz dtype and why."""
        if self.name != "muon":
            return {"name": self.name}
        return {"name": self.name, "muon_ns_dtype": self.ns_dtype, "muon_ns_dtype_reason": self.ns_dtype_reason}

    def _adamw(self, params, lr: float) -> torch.optim.AdamW:
        return torch.optim.AdamW(params, lr=lr, betas=tuple(self.cfg.betas), weight_decay=self.cfg.weight_decay)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.parts.values() for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.parts.values() for p, s in opt.state.items()}

    def set_lr(self, lr: float) -> None:
        """The schedule's lr for this step (Muon's scaled by optim.muon_lr_ratio)."""
        for name, opt in self.parts.items():
            for group in opt.param_groups:
                group["lr"] = lr * self.cfg.muon_lr_ratio if name == "muon" else lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.parts.values():
            opt.step()

    def state_dict(self) -> dict:
        if self.name == "adamw":
            return self.parts["adamw"].state_dict()
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        saved = saved_optimizer(state)
        if saved != self.name:
            raise ConfigError(
                f"the checkpoint's optimizer state is optim={saved}'s, this run's optimizer is optim={self.name}: "
                f"resume with optim={saved}, or start a new run from its weights with model.init_from=RUN_DIR"
            )
        parts = self.split_state(state)
        for name in sorted({*parts, *self.parts}):
            saved_n = _held(parts[name]) if name in parts else 0
            n = _held(self.parts[name].state_dict()) if name in self.parts else 0
            if saved_n != n:  # torch would refuse with "a parameter group that doesn't match the size"
                raise ConfigError(
                    f"the checkpoint's {name} optimizer holds {saved_n} parameters, this run's {n}: the run splits the "
                    "drafter between Muon and AdamW otherwise (optim.muon_exclude, or a family's vocabulary tables, "
                    "Muon's before #48); start a new run from its weights with model.init_from=RUN_DIR"
                )
        for name, part_state in parts.items():
            self.parts[name].load_state_dict(part_state)
        self.apply_config()

    def split_state(self, state: dict) -> dict:
        """A saved state_dict as {part name: that optimizer's state_dict}."""
        return {"adamw": state} if self.name == "adamw" else state

    def apply_config(self) -> None:
        """A loaded state brings its saved hyperparameters; the resumed config's own win (lr is set every step
        anyway), so `resume=RUN optim.weight_decay=...` does what it says."""
        for name, opt in self.parts.items():
            for group in opt.param_groups:
                if name == "muon":
                    group["weight_decay"] = self.cfg.muon_weight_decay
                    group["momentum"] = self.cfg.muon_momentum
                    group["ns_steps"] = self.cfg.muon_ns_steps
                    group["adjust_lr_fn"] = self.cfg.muon_adjust_lr
                else:
                    group["betas"] = tuple(self.cfg.betas)
                    group["weight_decay"] = self.cfg.weight_decay


def _held(state: dict) -> int:
    """Parameters an optimizer's state_dict holds, over its groups."""
    return sum(len(group["params"]) for group in state["param_groups"])


def saved_optimizer(state: dict) -> str:
    """Which optim option saved this single-process optimizer state: AdamW's own state_dict has `param_groups`."""
    return "adamw" if "param_groups" in state else "muon"
