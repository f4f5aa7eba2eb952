"""LoRA adapters as a PEFT adapter directory (Hugging Face PEFT's published checkpoint format).

``adapter_config.json`` holds the LoRA hyperparameters (``peft_type`` LORA, ``r``, ``lora_alpha``,
``lora_dropout``, ``target_modules``, ``task_type`` CAUSAL_LM, ...); ``adapter_model.safetensors``
one pair of tensors per adapted projection, in PyTorch's ``nn.Linear`` layout ([out, in]):

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, in]   = A^T
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [out, r]  = B^T

so PEFT's merge ``W + (lora_alpha / r) * lora_B @ lora_A`` (torch layout) is exactly the
learner's ``W + (alpha / r) * A B`` (Flax layout, ``stoker.learner.lora``). The safetensors
metadata records the policy version the adapters belong to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from stoker.learner.lora import LoraConfig

ADAPTER_DIR = "adapter"  # in a run directory, and in an export
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model.model."
VERSION_KEY = "stoker_policy_version"


def adapter_config(config: LoraConfig, base_model: str | None) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": list(config.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "modules_to_save": None,
    }


def write_adapter(
    directory: Path, adapters: dict[str, dict[str, Any]], config: LoraConfig, *, base_model: str | None, version: int
) -> Path:
    """Write the PEFT directory (replacing what was there, file by file atomically)."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for path, adapter in adapters.items():
        tensors[f"{PREFIX}{path}.lora_A.weight"] = np.ascontiguousarray(np.asarray(adapter["a"], np.float32).T)
        tensors[f"{PREFIX}{path}.lora_B.weight"] = np.ascontiguousarray(np.asarray(adapter["b"], np.float32).T)
    partial = directory / (WEIGHTS_FILE + ".partial")
    save_file(tensors, str(partial), metadata={"format": "pt", VERSION_KEY: str(version)})
    os.replace(partial, directory / WEIGHTS_FILE)
    config_partial = directory / (CONFIG_FILE + ".partial")
    config_partial.write_text(json.dumps(adapter_config(config, base_model), indent=2) + "\n")
    os.replace(config_partial, directory / CONFIG_FILE)
    return directory


def read_adapter(directory: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], int | None]:
    """(adapter_config.json, tensors by PEFT name, the policy version or None)."""
    from safetensors import safe_open

    config = json.loads((directory / CONFIG_FILE).read_text())
    tensors: dict[str, np.ndarray] = {}
    with safe_open(str(directory / WEIGHTS_FILE), framework="numpy") as handle:
        metadata = handle.metadata() or {}
        for key in handle.keys():
            tensors[key] = handle.get_tensor(key)
    version = metadata.get(VERSION_KEY)
    return config, tensors, int(version) if version is not None else None


def merge_into(weights: dict[str, np.ndarray], directory: Path) -> dict[str, np.ndarray]:
    """Hugging Face-named base weights ([out, in] projections) with a PEFT adapter merged in, as
    PEFT merges it: ``W + (lora_alpha / r) lora_B @ lora_A``."""
    config, tensors, _ = read_adapter(directory)
    scale = float(config["lora_alpha"]) / float(config["r"])
    out = dict(weights)
    for key, lora_a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        lora_b = tensors[key.replace(".lora_A.", ".lora_B.")]
        name = f"{module}.weight"
        w = np.asarray(out[name], np.float32)
        out[name] = (w + scale * (lora_b.astype(np.float32) @ lora_a.astype(np.float32))).astype(np.asarray(out[name]).dtype)
    return out


def copy_run_adapter(run_dir: Path, target: Path, exported_version: int | None) -> str | None:
    """Copy a LoRA run's adapter directory into an export (``target/adapter``); the name copied,
    or None for a run without one. Warns when the adapter (written with each checkpoint) is of
    another policy version than the exported weights (published each step)."""
    import shutil
    import sys

    source = run_dir / ADAPTER_DIR
    if not (source / CONFIG_FILE).is_file():
        return None
    _, _, version = read_adapter(source)
    if exported_version is not None and version is not None and version != exported_version:
        print(
            f"stoker export: warning: {source} is policy version {version}, the exported weights version "
            f"{exported_version} (the adapter is written with each checkpoint)", file=sys.stderr,
        )
    (target / ADAPTER_DIR).mkdir(parents=True, exist_ok=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        shutil.copyfile(source / name, target / ADAPTER_DIR / name)
    return ADAPTER_DIR + "/"
