"""bench/gpu_check.py, the one command a GPU session runs, tested where there is none: its dry run
lists every step and runs the CPU-runnable ones, and what it prepares for a bare GPU machine (a
cache holding SmolLM2's tokenizer and config, no weights) serves the tiny model and SmolLM2's
architecture without converting anything."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from textrl.config import CONF_DIR, load_model_config
from textrl.policy.model import build_policy, load_tokenizer, model_cache_dir

ROOT = CONF_DIR.parent
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402  (bench/ is a script directory)


def test_the_dry_run_lists_every_step_and_runs_the_cpu_runnable_ones(tmp_path):
    out = tmp_path / "gpu_check.json"
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] and result["failed"] == [] and "command" in result
    assert list(result["steps"]) == [s.name for s in gpu_check.steps()]
    for name in ("iteration/bf16-mixed", "iteration/16-mixed", "iteration/memory=qlora", "iteration/trainer=gpu",
                 "rollout/256", "ddp"):
        assert result["steps"][name]["status"] == "listed (runs on a GPU)"
    tests = result["steps"]["cuda_tests"]
    assert tests["counts"]["skipped"] == len(tests["tests"]) >= 10  # every CUDA test collected, none runs here
    fp32 = result["steps"]["iteration/32-true"]
    assert fp32["status"].startswith("ran") and fp32["precision"] == "32-true"
    assert fp32["policy/first_logratio_max"] < 1e-4 and fp32["perf/update_tokens"] > 0
    rollout = result["steps"]["rollout/16"]
    assert rollout["decisions"] > 0 and rollout["model_calls"] > 0 and rollout["ms_per_model_call"] > 0


def test_without_a_gpu_the_real_run_refuses_and_names_the_dry_run(tmp_path):
    if torch.cuda.is_available():
        return  # on a GPU the command is the check itself
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(tmp_path / "x.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "--dry-run" in run.stderr and not (tmp_path / "x.json").exists()


def test_a_cache_of_smollm2s_tokenizer_and_config_alone_serves_the_tiny_model_and_random_smollm2(tmp_path, monkeypatch):
    prepared = gpu_check.prepare(tmp_path)
    cache = tmp_path / "cache"
    folder = model_cache_dir(cache) / "smollm2"
    assert Path(prepared["prepared"]) == folder and "tokenizer.json" in prepared["files"]
    assert not list(folder.glob("*.safetensors"))  # no weights: a few MB to carry
    site = Path(prepared["site"])
    for module in ("hydra", "omegaconf", "textworld", "tatsu", "bitsandbytes"):
        assert (site / module / "__init__.py").is_file(), module
    assert (site / "jericho" / "libfrotz.so").is_file() and not (site / "test").exists()
    assert {p.name for p in (site / "bitsandbytes").glob("libbitsandbytes_*")} == {
        "libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so", "libbitsandbytes_cuda132.so"}
    tokenizer = load_tokenizer(load_model_config("tiny"), cache)
    assert tokenizer("open the door").input_ids and not list(folder.glob("*.safetensors"))  # nothing converted
    monkeypatch.setenv("TEXTRL_CACHE", str(cache))
    overrides = gpu_check.random_weights()
    cfg = gpu_check.compose([f"output_dir={tmp_path / 'run'}", *overrides]).model
    policy, random_tokenizer = build_policy(cfg, cache_dir=cache)
    config = json.loads((folder / "config.json").read_text())
    assert policy.lm.config.num_hidden_layers == config["num_hidden_layers"]
    assert policy.lm.config.hidden_size == config["hidden_size"]
    assert random_tokenizer.get_vocab() == tokenizer.get_vocab()
