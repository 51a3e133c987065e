"""Typed schemas for every config group, registered in Hydra's ConfigStore, and value checks.

`conf/config.yaml` starts its defaults list with `base_config` (the `Config` dataclass below), so every
YAML file of every group is merged into a typed node: a misspelt key or a wrong type fails at composition,
before `launch.py` runs a line of ours. Value checks that types cannot express (ranges, cross-field rules)
live in `validation.validate()`, which `lifecycle.main` calls before loading any model; the rules that need the target's
config (layer count, mask token id) are checked where it is read (model/build.py), before weights load.

One source of every default: a dataclass field's default is the value the default run composes
(`python launch.py`); a group option's YAML sets only what makes it that option (tests/test_config.py checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


class ConfigError(ValueError):
    """A config value a user set is out of range or inconsistent; the message names the dotted key."""


# conf/ beside the package (launch.py composes it; benchmarks and tests compose it too)
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

# Allowed values: the one home of each list (validate() checks them; the dispatching modules and CLIs import them).
LOSS_NAMES = ("ce_decay", "kl", "kl_streak", "dpace")
LABEL_SOURCES = ("data", "target")  # loss.labels
DRAFTER_NAMES = ("dflash", "dspark", "dflash2")  # dflash/model/families/
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
SCHEDULE_NAMES = ("cosine", "constant", "wsd")
OPTIM_NAMES = ("adamw", "muon")
PRECISION_NAMES = ("fp32", "bf16-mixed")  # train.precision, named as Lightning's `precision=` names them
DTYPE_NAMES = ("float32", "bfloat16", "float16")
ATTENTION_NAMES = ("auto", "sdpa", "flex")
# model.build.architecture: the random kinds' family (dflash/model/tiny_architectures.py)
ARCHITECTURES = ("qwen3", "llama", "qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_5_moe_vl", "qwen3_next")
ARCHITECTURES += ("gemma4_text", "gemma4_vl", "gpt_oss")
BUILD_KINDS = ("none", "tiny", "tiny_random", "tiny_chat", "random", "gguf_wheel")
WANDB_MODES = ("online", "offline", "disabled")
DATA_NAMES = ("stdlib", "jsonl", "tokens")
BAD_RECORD_POLICIES = ("fail", "skip")
PIPELINE_MODES = ("async", "sync")
PARALLEL_NAMES = ("single", "ddp", "fsdp")
BACKENDS = ("auto", "nccl", "gloo")

# z-lab's per-block-size default for the position decay (paper App. A.1); other sizes interpolate.
DEFAULT_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass
class TinyBuildConfig:
    """How `model.target` is made when it does not exist yet: built by `dflash/model/tiny.py` (the embedded
    targets), or fetched from the package index and converted by `dflash/model/gguf_target.py` (gguf_wheel)."""

    # none: model.target is a hub name or a directory (every real model); the sizes are model=tiny's
    # none | tiny | tiny_random | tiny_chat | random (random weights at any widths, e.g. Qwen3-8B's) | gguf_wheel
    kind: str = "none"
    architecture: str = "qwen3"  # the random kinds' family: qwen3_5(_vl), gemma4_text, gpt_oss, ... (ARCHITECTURES)
    tokenizer: str = "embedded"  # embedded (trained on the stdlib) | qwen3_6 (Qwen3.5/3.6's real one, offline)
    vocab_size: int = 2048  # the embedded tokenizer's vocabulary
    # rows of the model's embedding and LM head; null = the tokenizer's. Larger: ids above the tokenizer's range
    # are valid (a real mask id such as Qwen3's 151669) but never produced by the tokenizer
    model_vocab_size: int | None = None
    tie_word_embeddings: bool = True  # one matrix for embedding and LM head (Qwen3-8B has two; one will do here)
    hidden_size: int = 256
    num_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    max_position_embeddings: int = 2048
    pretrain_steps: int = 400  # steps of causal-LM pretraining on stdlib sources
    pretrain_seq_len: int = 128
    pretrain_batch_size: int = 16
    pretrain_lr: float = 3e-3
    chat_records: int = 0  # tiny_chat: ShareGPT conversations pretrained on besides the stdlib (model/tiny_chat.py)
    seed: int = 0
    # gguf_wheel: the pinned wheel on the package index, the GGUF file inside it, and that file's sha256
    package: str | None = None
    package_file: str | None = None
    sha256: str | None = None


@dataclass
class ModelConfig:
    name: str = MISSING
    target: str = MISSING  # HF hub name or local path of the target causal LM
    # the target's hub name and license for the export's model card (drafter/README.md); null: model.target, "other"
    base_model: str | None = None
    license: str | None = None
    block_size: int = 8  # tokens per drafted block, anchor included (SGLang num-draft-tokens)
    num_draft_layers: int = 2
    target_layer_ids: list[int] | None = None  # null = z-lab spread from layer 1 to L-3
    num_target_features: int | None = None  # with target_layer_ids null: how many ids (null = num_draft_layers)
    mask_token_id: int | None = None  # null = the tokenizer's <|MASK|> token
    mask_token: str = "<|MASK|>"
    dtype: str = "float32"  # float32 | bfloat16 | float16 (target and drafter weights)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attention: str = "auto"  # training attention: sdpa (dense bool mask) | flex (BlockMask, CUDA) | auto
    # the drafter's layer kinds (docs/training.md, dflash/model/window.py), in training and decoding alike:
    # layer_types: a full_attention | sliding_attention per draft layer; null = every layer full, or every layer
    # sliding when sliding_window is set. sliding_window W: a sliding layer's window (null = no sliding layer).
    # sliding_block: causal | bidirectional, the block in sliding layers (full ones are bidirectional); null = causal
    # with layer_types (z-lab's and vLLM's default, Qwen3.6-DFlash), bidirectional without (the uniform window).
    # window_origin: query (z-lab, vLLM: slot k sees a + k - W < c < a) | anchor (speculators: a - W <= c < a)
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    sliding_block: str | None = None
    window_origin: str = "query"
    # drafter attention/MLP shape; null = the target's value
    draft_num_attention_heads: int | None = None
    draft_num_key_value_heads: int | None = None
    draft_head_dim: int | None = None
    draft_intermediate_size: int | None = None
    # start the drafter from these weights instead of train.seed's init: a drafter directory in z-lab's layout
    # (config.json + model.safetensors: an export, ours or released) or a run directory (its newest checkpoint,
    # else its drafter/); checked against the target and this config first (dflash/train/init_from.py)
    init_from: str | None = None
    # the drafter's head over the N target tokens most frequent in the training labels (speculators' t2d/d2t maps,
    # counted once, cached under paths.cache_dir; dflash/model/draft_vocab.py); null = the target's whole vocabulary
    draft_vocab_size: int | None = None
    build: TinyBuildConfig = field(default_factory=TinyBuildConfig)


@dataclass
class LossConfig:
    name: str = "dpace"  # ce_decay | kl | kl_streak | dpace
    decay_gamma: float | None = None  # null = 7 / 5 / 4 for block 16 / 10 / 8
    kl_temperature: float = 1.0
    kl_weight: float = 0.0  # share of the T^2-scaled KL term; 1 - kl_weight to hard-label CE (kl, kl_streak: 0.5)
    streak_alpha: float = 0.0  # kl_streak's mix of the streak multiplier (0.5 there); 0 = plain decay
    dpace_alpha: float = 0.5  # dpace's confidence smoothing q~ = (1 - alpha) q + alpha (the peers' default)
    chunk_size: int = 256  # positions per fused LM-head + loss chunk
    labels: str = "data"  # the hard labels: the text's next tokens, or `target`: the target's argmax
    # DSpark's terms beside the above (drafter=dspark; model/families/dspark_loss.py): the total variation between
    # the draft's and the target's distributions (1 - the rejection-sampling acceptance rate), weighted like CE
    tv_weight: float = 0.0
    # the confidence head's BCE against that acceptance rate, decay-weighted; null = 1.0 where the drafter has a
    # confidence head (a value without one is refused)
    confidence_weight: float | None = None
    # DFlash2's selector term (model/families/dflash2_loss.py): its k-way CE, decay-weighted; null = 1.0 with
    # drafter=dflash2 (a value with another drafter is refused)
    selector_weight: float | None = None


@dataclass
class DrafterConfig:
    """The drafter family (dflash/model/families/), on the DFlash backbone that model.* shapes. `dflash`: z-lab's
    drafter. `dspark` (arXiv 2607.05147; speculators' DSparkSpeculatorConfig): a low-rank Markov logit bias (each
    drafted position conditions on the token before it in the block, chosen sequentially at decoding) and a
    confidence head (each position's acceptance probability)."""

    name: str = "dflash"  # dflash | dspark | dflash2
    # dspark: the anchor's slot predicts too (speculators' sample_from_anchor), so a forward of model.block_size - 1
    # slots [anchor, MASK...] drafts the model.block_size - 1 tokens a cycle verifies; false: DFlash's block of
    # model.block_size slots whose anchor slot predicts nothing
    sample_from_anchor: bool = True
    markov_rank: int = 256  # dspark: rank of the bias W2 @ W1[previous token]; 0 = no Markov head
    markov_head_type: str = (
        "vanilla"  # dspark: vanilla | gated (gate from the hidden state) | rnn (state over the block)
    )
    confidence_head: bool = True  # dspark: predict each drafted position's acceptance probability
    confidence_head_with_markov: bool = True  # dspark: the confidence head reads [hidden; W1[previous token]]
    # dflash2 (inco.ai; speculators' DFlash2SpeculatorConfig): a dynamic causal convolution of conv_kernel_size taps
    # over the block around each sublayer, channels in groups of conv_group_size (a divisor of the hidden size)
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256  # dflash2: rank of the candidate selector's codebooks
    selector_top_k: int = 16  # dflash2: unary candidates the selector reranks per draft


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # cosine | constant | wsd
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.1
    decay_ratio: float = 0.2  # wsd: share of training spent in the final decay
    noise_start: float = 0.0  # std of Gaussian noise on target features at progress 0
    noise_end: float = 0.0  # ... at progress 1 (cosine in between)


@dataclass
class WandbConfig:
    mode: str = "offline"  # online | offline | disabled
    project: str = "dflash-train"
    entity: str | None = None
    name: str | None = None  # null = the job's override string or run dir name
    group: str | None = None  # null = sweep dir for multirun jobs, experiment name otherwise
    job_type: str = "train"
    tags: list[str] = field(default_factory=list)
    stats_interval_s: float = 10.0
    init_timeout_s: float = 60.0  # W&B's own start-up wait (it runs beside training, which does not wait)
    finish_timeout_s: float = 60.0  # at the end, wait at most this long for W&B to finish uploading


@dataclass
class LoggingConfig:
    log_every_s: float = 5.0  # console refresh interval (JSONL and W&B get every monitor tick)
    console: bool = True
    # summary.json's train/* metrics: the mean over this many last steps (not the last monitor window, whose
    # length depends on timing), so the same config and seed give the same summary
    summary_window_steps: int = 50
    report: bool = True  # write report.png (python -m dflash.report) into the run dir at the end
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class RegenerateConfig:
    """Train on the target's own continuations of prompts from the corpus (the paper regenerates responses
    with the target "for better target alignment"): the drafter learns what the target will actually say."""

    enabled: bool = True  # data=stdlib only (data=jsonl sets false: regenerate chat data offline)
    num_prompts: int = 4096
    prompt_len: int = 32  # prompt tokens (not supervised)
    max_new_tokens: int = 128  # generated tokens per prompt (supervised)
    temperature: float = 0.0  # 0 = greedy, matching greedy evaluation
    batch_size: int = 256


@dataclass
class DataConfig:
    name: str = MISSING  # stdlib | jsonl | tokens
    path: str | None = None  # jsonl: .jsonl or .json (array) files (a file, a directory, a glob); tokens: .npz files
    on_bad_record: str = "fail"  # fail | skip (counted by reason: data/skipped/<reason>)
    holdout_fraction: float = 0.05  # share of stdlib files / last jsonl records kept out of training (eval prompts)
    max_files: int | None = None  # stdlib: cap on source files read (null = all)
    min_supervised_tokens: int | None = None  # stdlib windows: null = 2 * block_size
    num_proc: int | None = None  # jsonl: processes that render the records (null = up to 8, one per core)
    pad_to_multiple_of: int = 64  # jsonl: a batch is as wide as its longest conversation, rounded up to this
    long_conversations: str = "split"  # jsonl, past train.seq_len: split (rows at turn boundaries) | truncate
    chat_template_kwargs: dict = field(default_factory=dict)  # jsonl: e.g. {enable_thinking: false} for Qwen3
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)


@dataclass
class PipelineConfig:
    mode: str = "async"  # async | sync
    queue_size: int = 4  # items per queue
    queue_bytes: int | None = None  # optional byte cap per queue (null = items only)
    target_workers: int = 1
    monitor_interval_s: float = 2.0
    join_timeout_s: float = 20.0
    threads_per_stage: int | None = None  # CPU: torch threads per stage (null = cores / stages)


@dataclass
class EvalConfig:
    name: str = "default"
    every_steps: int = 500  # 0 = only the final eval
    num_prompts: int = 8
    max_new_tokens: int = 64
    prompt_len: int = 64  # tokens of held-out text used as a prompt
    temperature: float = 0.0
    baselines: bool = True  # prompt-lookup + untrained drafter on the same prompts
    prompt_lookup_ngram: int = 3
    prompts_file: str | None = None
    final: bool = True
    # chooses the held-out prompts and seeds sampling; apart from train.seed so that runs of different training
    # seeds are measured on the same prompts (a seed's tau then differs by training, not by test set)
    seed: int = 0
    # benchmark suites run after the final eval (python -m dflash.benchmark's, e.g. [humaneval, sharegpt]) at
    # eval.temperature and eval.max_new_tokens; results in benchmarks.json and the bench/<suite>/* metrics
    suites: list[str] = field(default_factory=list)
    suite_max_samples: int | None = None  # rows per suite, sampled as z-lab samples (null = all)
    # true: tau (eval and suites) by exact replay of greedy verification over the target's cached greedy outputs
    # and features (<paths.cache_dir>/replay, shared by a sweep's jobs; evaluation/replay.py): no target decoding
    # per job, no speed or losslessness measured. false: full speculative decoding (a single run's final eval)
    replay: bool = False


@dataclass
class TrainConfig:
    max_steps: int = 1000
    max_tokens: int | None = None  # stop after this many target tokens (null = steps only)
    max_minutes: float | None = None  # end `completed` after this many minutes of training (train/time_budget.py)
    batch_size: int = 4
    seq_len: int = 256
    num_anchors: int = 32
    # null = off; else at most this many anchors in a (global) batch, spread over its rows in proportion to their
    # anchor positions, each row at most train.num_anchors (model/anchor_budget.py states the rule)
    anchor_budget: int | None = None
    seed: int = 0
    # the data order's seed (and so what a feature store holds); null = train.seed. Fix it to train several seeds
    # (drafter init, anchors, noise) from one feature store: `-m train.seed=0,1,2 train.data_seed=0`
    data_seed: int | None = None
    grad_clip: float = 1.0
    # moved to the optim group (optim.weight_decay, optim.betas): set, they are refused naming the new key
    weight_decay: float | None = None
    betas: list[float] | None = None
    max_bad_steps: int = 10
    deterministic: bool = False  # deterministic algorithms and one CPU thread per stage (dflash/core/determinism.py)
    # fp32 | bf16-mixed: the drafter's forward and loss under bfloat16 autocast, the LM head's matmuls in bfloat16,
    # weights, gradients and optimizer state in model.dtype (float32); on a CPU without fast bfloat16 kernels it
    # falls back to fp32 with one warning (dflash/train/precision.py)
    precision: str = "fp32"


@dataclass
class OptimConfig:
    """The optimizer (dflash/train/optimizers.py): `adamw` for every trainable parameter, or `muon`:
    torch.optim.Muon for the drafter's hidden weight matrices and AdamW for the rest (norms). The learning rate is
    the schedule's (schedule.lr), gradient clipping train.grad_clip."""

    name: str = "muon"  # muon | adamw (runs saved before this group existed were adamw: resume.py says so)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's (muon: its AdamW part's)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay (muon: its AdamW part's)
    # muon only: Muon's lr is schedule.lr times this (with match_rms_adamw Muon reuses AdamW's lr: ratio 1)
    muon_lr_ratio: float = 1.0
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    muon_ns_dtype: str = "auto"  # auto (float32 where bf16 is slow: dflash/train/muon.py) | bfloat16 | float32
    muon_adjust_lr: str = "match_rms_adamw"  # match_rms_adamw (Moonshot) | original (Keller Jordan)
    muon_exclude: list[str] = field(default_factory=list)  # names of 2-D weights kept on AdamW (e.g. [fc])


def data_seed(train) -> int:
    """The seed of the data order: train.data_seed, else train.seed."""
    seed = getattr(train, "data_seed", None)
    return train.seed if seed is None else seed


@dataclass
class ParallelConfig:
    """How many processes train one drafter. `single`: one process (no torch.distributed). `ddp` / `fsdp`:
    one process per device under torchrun (or SLURM through submitit), data-parallel drafter replicas
    (DistributedDataParallel, or FSDP2 `fully_shard` per decoder layer); `train.batch_size` is the global batch."""

    name: str = "single"  # single | ddp | fsdp
    backend: str = "auto"  # auto = nccl on CUDA, gloo on CPU
    init_timeout_s: float = 300.0  # joining the process group (ranks may wait for each other's preprocessing)
    timeout_s: float = 1800.0  # any later collective; long enough for rank 0's evals while the others wait
    mixed_precision: bool = True  # fsdp on CUDA: bf16 compute, fp32 gradient reduction
    target_devices: list[str] | None = None  # one process: a target replica (and target worker) per device
    drafter_device: str | None = None  # one process: the drafter's device (null = model.device)
    target_ranks: int = 0  # ddp under torchrun: the last K ranks only run the target and send features
    items_in_flight: int = 2  # target_ranks: items per target -> drafter link not yet taken by the drafter


@dataclass
class FeaturesConfig:
    """Where the target's features come from: `online` (the target runs in the pipeline) or `store` (read from a
    feature store built once by `python -m dflash.features build`; dflash/train/feature_store.py)."""

    name: str = "online"  # online | store
    path: str | None = None  # the store (null = under paths.cache_dir, named by what it holds)
    dtype: str = "float32"  # float32 | bfloat16 | fp8 (e4m3 + per-token scale): stored features (float32: bitwise)
    shard_batches: int = 16  # global batches per shard file
    build_missing: bool = False  # store: build what is missing first (the first job of a sweep; others wait)


@dataclass
class DebugConfig:
    """Fault injection for tests and drills (`+debug=faults debug.fail_at_step=3`); all off by default."""

    fail_at_step: int | None = None  # raise in the drafter stage at this step
    fail_target_at_batch: int | None = None  # raise in the target stage at this batch
    crash_at_step: int | None = None  # SIGKILL the whole process after this step (a node crash)
    fail_rank: int | None = None  # with torchrun: inject the faults above on this rank only (null = every rank)
    slow_step_s: float | None = None  # sleep this long in every drafter step (a slow drafter, for back-pressure)
    nan_at_step: int | None = None  # from this step on the loss is NaN (divergence drills: train.max_bad_steps)
    main_first_sleep_s: float | None = None  # rank 0 sleeps this long in its first data build (init timeouts)


@dataclass
class CheckpointConfig:
    every_steps: int = 250  # 0 = only at the end and on SIGTERM/SIGINT
    keep_last: int = 2
    enabled: bool = True
    # a periodic checkpoint that would not fit on the disk: stop (with one line, status failed) or skip it loudly
    # and keep training (the summary counts the skipped ones); the final checkpoint always stops
    on_disk_full: str = "stop"


@dataclass
class PathsConfig:
    cache_dir: str = "outputs/.cache"  # where locally built targets live (relative to the launch dir)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    experiment: str | None = None
    resume: str | None = None  # a run directory to continue
    # resume although the training data changed since the checkpoint (recorded in run.json); per command
    resume_accept_data_change: bool = False


def register_configs() -> None:
    node = OmegaConf.structured(Config)
    # Hydra closes every dict (struct mode), which would refuse the documented
    # `data.chat_template_kwargs='{enable_thinking: false}'` as a new key: a chat template's arguments are the
    # template's, not ours, so this one dict stays open (the flag set on the node outlives Hydra's root flag)
    OmegaConf.set_struct(node.data.chat_template_kwargs, False)
    ConfigStore.instance().store(name="base_config", node=node)


def default_decay_gamma(block_size: int) -> float:
    """Paper values for B = 16 / 10 / 8; linear in B elsewhere (gamma ~ B/2 - 1 fits all three)."""
    return DEFAULT_DECAY_GAMMA.get(block_size, max(1.0, block_size / 2.0 - 1.0))
