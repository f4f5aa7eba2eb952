"""``stoker export RUN_DIR|CHECKPOINT --to DIR``: a Hugging Face-format directory of the policy.

From a run directory (``stoker run``'s: ``runs.jsonl`` records the spec, ``weights/`` the published
versions) it takes the newest published weights; from a Hugging Face checkpoint directory, its
weights; from a learner's Orbax checkpoint directory (what a cluster learner leaves on its run
volume: ``RUN_DIR/checkpoints``, or ``RUN_DIR`` itself), the newest checkpoint's policy
(``stoker.learner.checkpoint_export``; LoRA: merged, plus the PEFT adapter). Either way it writes ``config.json`` (``stoker.hfconfig.config_to_hf``: the keys transformers documents,
rope settings in both its formats), ``model.safetensors`` with Hugging Face's tensor names, and
the tokenizer files of the checkpoint the run started from. ``stoker.model.hf.load_checkpoint``
(or transformers) reads it back to the same logits.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import jax.numpy as jnp
from flax import nnx
from pydantic import ValidationError

from stoker.checkpoint_files import checkpoint_tensors, stored_dtype
from stoker.hfconfig import CONFIG_FILE, CheckpointError
from stoker.learner.checkpoint_export import CheckpointExportError, is_checkpoint_dir, read_checkpoint
from stoker.learner.lora import LoraConfig
from stoker.learner.peft import ADAPTER_DIR, copy_run_adapter, write_adapter
from stoker.manifest import load_job
from stoker.model.hf import dtype_from_name, load_checkpoint, load_hf, save_checkpoint
from stoker.model.model import Transformer
from stoker.spec import RLJobSpec
from stoker.weights.channel import WeightsError, WeightSubscriber

RUN_RECORD = "runs.jsonl"
RUN_WEIGHTS = "weights"
# Everything a tokenizer and chat template need (transformers' file names).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
)


class ExportError(Exception):
    """The source cannot be exported (said in user terms)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", metavar="RUN_DIR|CHECKPOINT",
        help="a stoker run directory, a learner's run or Orbax checkpoint directory, or a Hugging Face checkpoint",
    )
    parser.add_argument("--to", required=True, metavar="DIR", help="where to write the Hugging Face-format directory")
    parser.add_argument(
        "--manifest", metavar="FILE",
        help="the job's manifest, for learner checkpoints that do not record their spec (or to override it)",
    )


def _from_run(run_dir: Path) -> tuple[Transformer, Path | None, int]:
    """The newest published policy of a run, the directory its tokenizer files are in, its version."""
    lines = [line for line in (run_dir / RUN_RECORD).read_text().splitlines() if line.strip()]
    try:
        spec = RLJobSpec.model_validate(json.loads(lines[-1])["spec"])
    except (IndexError, KeyError, json.JSONDecodeError, ValidationError) as err:
        raise ExportError(f"{run_dir / RUN_RECORD}: no readable run record ({err})") from None
    try:
        latest = WeightSubscriber(directory=run_dir / RUN_WEIGHTS).fetch_latest()
    except WeightsError as err:
        raise ExportError(f"{run_dir / RUN_WEIGHTS}: {err}") from None
    if latest is None:
        raise ExportError(f"{run_dir / RUN_WEIGHTS}: no published weights yet")
    version, flat = latest
    dtype = dtype_from_name(spec.model.dtype)
    config = spec.model.architecture
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype))
    load_hf(model, flat)
    return model, _tokenizer_dir(spec), version


def _checkpoint_dtype(directory: Path) -> jnp.dtype:
    """The dtype a checkpoint's weights are stored in (bfloat16 stays bfloat16): the one its float
    tensors share, else config.json's ``dtype``/``torch_dtype``, else float32."""
    name = stored_dtype(checkpoint_tensors(directory))
    if name is None:
        hf = json.loads((directory / CONFIG_FILE).read_text())
        name = hf.get("dtype") or hf.get("torch_dtype")
    try:
        return dtype_from_name(str(name))
    except CheckpointError:
        return jnp.dtype(jnp.float32)  # float64 (or an unknown name): the loader's default


def _tokenizer_dir(spec: RLJobSpec) -> Path | None:
    """Where the job's tokenizer files are: its tokenizer's directory, else its checkpoint's
    (``model.tokenizer: builtin``: none to copy)."""
    if spec.model.tokenizer == "builtin":
        return None
    if spec.model.checkpoint:
        return Path(spec.model.checkpoint)
    if spec.model.tokenizer:
        return Path(spec.model.tokenizer).parent if Path(spec.model.tokenizer).is_file() else Path(spec.model.tokenizer)
    return None


def _learner_checkpoints(source: Path) -> Path | None:
    """The Orbax checkpoint directory ``source`` is, or holds under the default ``checkpoints``."""
    for candidate in (source, source / "checkpoints"):
        if is_checkpoint_dir(candidate):
            return candidate
    return None


def _has_published_weights(run_dir: Path) -> bool:
    return (run_dir / RUN_WEIGHTS).is_dir() and any((run_dir / RUN_WEIGHTS).iterdir())


def export(source: str | Path, target: str | Path, manifest: str | Path | None = None) -> tuple[Path, list[str]]:
    """Write the HF directory; returns it and the tokenizer files copied."""
    source, target = Path(source), Path(target)
    tokenizer_dir: Path | None
    version = None
    adapters = None
    checkpoints = None if (source / CONFIG_FILE).exists() else _learner_checkpoints(source)
    if (source / CONFIG_FILE).exists():
        model, tokenizer_dir = load_checkpoint(source, dtype=_checkpoint_dtype(source)), source
    elif (source / RUN_RECORD).exists() and (_has_published_weights(source) or checkpoints is None):
        model, tokenizer_dir, version = _from_run(source)
    elif checkpoints is not None:  # a cluster learner's: no published weights, its checkpoints
        spec = None
        if manifest is not None:  # a bad one raises ManifestError: the CLI prints its problems
            spec = load_job(manifest).spec
        try:
            policy = read_checkpoint(checkpoints, spec)
        except CheckpointExportError as err:
            raise ExportError(str(err)) from None
        model, tokenizer_dir, adapters = policy.model, _tokenizer_dir(policy.spec), policy.adapters
        lora_spec = policy.spec.model.lora
    else:
        raise ExportError(
            f"{source}: neither a checkpoint (no {CONFIG_FILE}), a run directory (no {RUN_RECORD}) "
            "nor a learner's checkpoint directory"
        )
    if (target / CONFIG_FILE).exists():
        raise ExportError(f"{target} already holds a {CONFIG_FILE}; export to a new directory")
    if target.resolve() == source.resolve():
        raise ExportError("--to must differ from the source")
    save_checkpoint(model, target)
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        print(f"stoker export: warning: {tokenizer_dir} (the job's tokenizer) is not here; no tokenizer files copied",
              file=sys.stderr)
    copied = []
    for name in TOKENIZER_FILES:
        if tokenizer_dir is not None and (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, target / name)
            copied.append(name)
    if adapters is not None:  # LoRA from checkpoints: the adapters of that very step as a PEFT directory
        assert lora_spec is not None
        config = LoraConfig(lora_spec.rank, lora_spec.alpha, tuple(lora_spec.targets), lora_spec.dropout)
        write_adapter(target / ADAPTER_DIR, adapters, config, base_model=policy.spec.model.checkpoint, version=policy.version)
        copied.append(ADAPTER_DIR + "/")
    elif version is not None:  # a LoRA run: its PEFT adapter directory too (stoker.learner.peft)
        adapter = copy_run_adapter(source, target, version)
        if adapter is not None:
            copied.append(adapter)
    return target, copied


def main(args: argparse.Namespace) -> int:
    try:
        target, copied = export(args.source, args.to, args.manifest)
    except (ExportError, CheckpointError) as err:
        print(f"stoker export: {err}", file=sys.stderr)
        return 2
    print(f"wrote {target} (config.json, model.safetensors{''.join(', ' + c for c in copied)})")
    return 0
