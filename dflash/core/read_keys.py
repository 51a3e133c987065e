"""Which option of its group reads a key: an override of a key the chosen option does not read warns, naming the
option that would; a sweep over one that no job reads is refused (dflash/core/override_effects.py)."""

from __future__ import annotations

# Keys that only some options of their group read (the others ignore them), read off the code: model/losses.py
# (_kl_coefficients, _uses_kl), model/loss_weights.py (position_weights), train/schedules.py (lr_at),
# train/pipeline.py and run.py (sync: one thread, no queues, one target worker). An override of one that the chosen
# option does not read warns, naming the option that would; a sweep over one that no job reads is refused
# (dflash/core/override_effects.py). A group's option is the value of its key in OPTION_KEYS.
OPTION_KEYS = {"loss": "loss.name", "schedule": "schedule.name", "pipeline": "pipeline.mode", "optim": "optim.name"}
READ_ONLY_BY = {
    "loss.decay_gamma": ("ce_decay", "kl", "kl_streak"),
    "loss.kl_weight": ("kl", "kl_streak", "dpace"),
    "loss.kl_temperature": ("kl", "kl_streak", "dpace"),
    "loss.streak_alpha": ("kl_streak",),
    "loss.dpace_alpha": ("dpace",),
    "schedule.min_lr_ratio": ("cosine", "wsd"),
    "schedule.decay_ratio": ("wsd",),
    "pipeline.queue_size": ("async",),
    "pipeline.queue_bytes": ("async",),
    "pipeline.target_workers": ("async",),
    "optim.muon_lr_ratio": ("muon",),
    "optim.muon_momentum": ("muon",),
    "optim.muon_weight_decay": ("muon",),
    "optim.muon_ns_steps": ("muon",),
    "optim.muon_adjust_lr": ("muon",),
    "optim.muon_ns_dtype": ("muon",),
    "optim.muon_exclude": ("muon",),
}
# ... and read only while another key is not at a value: kl_weight 0 drops the KL term, markov_rank 0 the Markov head
UNREAD_WHILE = {"loss.kl_temperature": ("loss.kl_weight", 0.0), "drafter.markov_head_type": ("drafter.markov_rank", 0)}
UNREAD_WHILE["drafter.confidence_head_with_markov"] = ("drafter.confidence_head", False)  # no head, no Markov input
# ... and unread where every key of a set is at its value (model/losses.py's _kl_coefficients and
# families.family_loss): loss=kl's CE term is the only reader of loss.labels (kl_streak's and dpace's position weights
# and DFlash2's selector read the labels too), and kl_weight=1 drops it: labels=target would train as labels=data
UNREAD_WHERE = {
    "loss.labels": (
        {"loss.name": "kl", "loss.kl_weight": 1.0, "drafter.name": "dflash"},
        "loss=kl with loss.kl_weight=1 has no CE term, the only reader of the labels (set loss.kl_weight < 1)",
    )
}
# the drafter families (dflash/model/families/): a family's own keys are read by that family only
OPTION_KEYS["drafter"] = "drafter.name"
READ_ONLY_BY.update(
    {
        "drafter.sample_from_anchor": ("dspark",),
        "drafter.markov_rank": ("dspark",),
        "drafter.markov_head_type": ("dspark",),
        "drafter.confidence_head": ("dspark",),
        "drafter.confidence_head_with_markov": ("dspark",),
        "drafter.conv_kernel_size": ("dflash2",),
        "drafter.conv_group_size": ("dflash2",),
        "drafter.selector_rank": ("dflash2",),
        "drafter.selector_top_k": ("dflash2",),
    }
)
# W&B's keys (dflash/tracking/) are read only while W&B is on: logging=jsonl and --no-wandb turn it off
OPTION_KEYS["logging"] = "logging.wandb.mode"
_WANDB_KEYS = ("project", "entity", "name", "group", "job_type", "tags", "stats_interval_s", "init_timeout_s")
READ_ONLY_BY.update({f"logging.wandb.{k}": ("online", "offline") for k in (*_WANDB_KEYS, "finish_timeout_s")})
