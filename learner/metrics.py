"""Learner metrics: XLA compilation counting, duty cycle, JSONL, TensorBoard, W&B and Prometheus sinks.

Duty cycle = time spent inside train steps / wall time since the loop started: the fraction of
the run the accelerator had work. A learner waiting on the buffer (actors too slow) shows it first.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import prometheus_client as prom

from stoker.endpoints import Address
from stoker.jsonl import json_line
from stoker.metrics_http import serve_metrics

log = logging.getLogger(__name__)

# The event JAX records around every backend compilation (a persistent-cache hit included).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Tracing to a jaxpr and lowering it to MLIR, which precede every compilation.
FRONTEND_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts XLA compilations process-wide through ``jax.monitoring`` listeners.

    ``count`` is every backend compilation (by function name in ``by_function``), ``seconds`` their
    total time, ``frontend_seconds`` the tracing and lowering before them, ``cache_hits`` the ones
    served from the persistent compilation cache. One counter
    is installed per process (``install``); listeners cannot be removed individually.
    """

    _instance: CompileCounter | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.seconds = 0.0
        self.frontend_seconds = 0.0
        self.cache_hits = 0
        self.by_function: Counter[str] = Counter()

    @classmethod
    def install(cls) -> CompileCounter:
        if cls._instance is None:
            import jax.monitoring

            counter = cls()
            jax.monitoring.register_event_duration_secs_listener(counter._on_duration)
            jax.monitoring.register_event_listener(counter._on_event)
            cls._instance = counter
        return cls._instance

    def _on_duration(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == BACKEND_COMPILE_EVENT:
            with self._lock:
                self.count += 1
                self.seconds += duration_secs
                self.by_function[str(kwargs.get("fun_name", "?"))] += 1
        elif event in FRONTEND_EVENTS:
            with self._lock:
                self.frontend_seconds += duration_secs

    def _on_event(self, event: str, **kwargs: str | int) -> None:
        if event == CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1


class DutyCycle:
    """Fraction of wall time spent inside ``busy()`` blocks since construction."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.busy_seconds = 0.0

    def add(self, seconds: float) -> None:
        self.busy_seconds += seconds

    @property
    def value(self) -> float:
        wall = time.perf_counter() - self.started
        return min(self.busy_seconds / wall, 1.0) if wall > 0 else 0.0


# Gauges exported to Prometheus: metric key -> help text. Other keys go to the JSONL log only.
PROMETHEUS_GAUGES: dict[str, str] = {
    "policy_version": "Policy version after the last update",
    "step_seconds": "Wall time of the last train step",
    "duty_cycle": "Time inside train steps / wall time",
    "tokens_per_second": "Real (non-pad) tokens per second of train-step time",
    "compilations": "XLA compilations so far in this process",
    "compile_cache_hits": "Compilations served from the persistent cache",
    "padding_waste": "Pad tokens / all tokens of the last batch",
    "loss": "Total loss of the last batch",
    "pg_loss": "Policy-gradient loss of the last batch",
    "reward_mean": "Mean episode reward of the last batch",
    "staleness_mean": "Mean policy versions behind of trained tokens",
    "staleness_max": "Largest policy versions behind of a trained token",
    "stale_tokens": "Tokens dropped from the last batch for exceeding maxStaleness",
    "is_weight_mean": "Mean importance weight pi_old/mu",
    "is_weight_max": "Largest importance weight pi_old/mu",
    "is_clipped_fraction": "Fraction of tokens whose importance weight was truncated",
    "ratio_clipped_fraction": "Fraction of trained tokens whose PPO ratio was outside the clip range",
    "tito_logprob_diff_mean": "Trainer minus sampler log-prob on same-version tokens (mean)",
    "tito_logprob_diff_std": "Trainer minus sampler log-prob on same-version tokens (std)",
    "grad_norm": "Global gradient norm before clipping",
    "moe_aux_loss": "Mixture of experts: the router's load-balancing loss of the last batch (k when balanced)",
    "moe_expert_load_max": "Mixture of experts: the busiest expert's share of the routed tokens",
    "moe_dropped_fraction": "Mixture of experts: routed (token, expert) pairs past an expert's capacity",
    "nonfinite_updates": "Updates skipped for a non-finite gradient, this process",
    "learning_rate": "Learning rate of the last update",
    "sampled_tokens": "Model tokens the actors sampled in the last batch, trained or not",
    "trained_tokens": "Model tokens of the last batch that entered the loss",
    "completion_tokens_mean": "Mean sampled tokens per episode of the last batch",
    "truncation_rate": "Fraction of the last batch's episodes that were truncated",
    "failed_episodes": "Failed or timed-out episodes in the last batch",
    "eval_success_rate": "Held-out success (greedy) of the newest evaluation round",
    "eval_reward_mean": "Mean reward of the newest evaluation round",
    "eval_policy_version": "Policy version of the newest evaluation round",
}


TENSORBOARD_DIR = "tensorboard"  # beside the JSONL file: <dir>/tensorboard/<jsonl stem>/events.out.tfevents.*


_ILLEGAL_TAG = re.compile(r"[^-/\w.]")


def tensorboard_tag(key: str) -> str:
    """``key`` with the characters TensorBoard refuses replaced (tensorboardX would warn about
    each one at every step)."""
    return _ILLEGAL_TAG.sub("_", key)


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The plottable entries of a metrics record: real numbers (bools and strings left out)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}


class WandbLogger:
    """Weights & Biases, when the ``wandb`` package is installed and ``WANDB_PROJECT`` is set.

    Offline unless ``WANDB_MODE`` says otherwise or ``WANDB_API_KEY`` is set: runs are written
    under ``directory`` and uploaded later with ``wandb sync``, so a cluster without internet access
    still records them. wandb is never a dependency of Stoker; ``create`` returns None without it."""

    def __init__(self, run: Any):
        self.run = run

    @classmethod
    def create(cls, directory: Path, name: str) -> WandbLogger | None:
        project = os.environ.get("WANDB_PROJECT")
        if not project:
            return None
        try:
            import wandb
        except ImportError:
            log.warning("WANDB_PROJECT is set but wandb is not installed; not logging to Weights & Biases")
            return None
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        directory.mkdir(parents=True, exist_ok=True)
        return cls(wandb.init(project=project, name=name, dir=str(directory), mode=mode))

    def log(self, values: dict[str, float], step: int | None) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsSink:
    """Writes each step's metrics as one JSON line, as TensorBoard scalars beside it (and to W&B,
    see ``WandbLogger``), and keeps Prometheus gauges current.

    ``serve``: serve ``/metrics`` there, a port or a unix socket (None = do not serve; the gauges
    still live in ``registry``; one that cannot listen is logged and off).
    The TensorBoard and W&B step is the record's ``step`` (batches consumed), else a count of records.
    """

    def __init__(self, jsonl_path: str | Path | None, *, serve: Address | None = None, prefix: str = "stoker_learner"):
        self.registry = prom.CollectorRegistry()
        self.gauges = {
            key: prom.Gauge(f"{prefix}_{key}", help_text, registry=self.registry)
            for key, help_text in PROMETHEUS_GAUGES.items()
        }
        self.steps = prom.Counter(f"{prefix}_steps", "Train steps taken", registry=self.registry)
        self._file: IO[str] | None = None
        self._tensorboard: Any = None
        self._wandb: WandbLogger | None = None
        self._samples: Any = None  # a stoker.learner.samples.SampleLog, once attached
        self._records = 0
        if jsonl_path is not None:
            path = Path(jsonl_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            from tensorboardX import SummaryWriter

            self._tensorboard = SummaryWriter(str(path.parent / TENSORBOARD_DIR / path.stem))
            self._wandb = WandbLogger.create(path.parent, path.stem)
        self._endpoint = serve_metrics(serve, self.registry, where="learner metrics") if serve is not None else None

    def record(self, metrics: dict[str, float]) -> None:
        self.steps.inc()
        self._records += 1
        for key, gauge in self.gauges.items():
            if key in metrics:
                gauge.set(metrics[key])
        if self._file is not None:
            self._file.write(json_line({"time": time.time(), **metrics}, sort_keys=True))
            self._file.flush()
        values = scalars(metrics)
        step = int(values.get("step", self._records))
        if self._tensorboard is not None:
            for key, value in values.items():
                if math.isfinite(value):
                    self._tensorboard.add_scalar(tensorboard_tag(key), value, global_step=step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(values, step)

    def attach_samples(self, samples: Any) -> None:
        """Decoded sample episodes (``SampleLog``) go beside the metrics, their text to TensorBoard."""
        samples.text = self.add_text
        self._samples = samples

    def record_episodes(self, step: int, episodes: Any) -> None:
        """A trained batch's episodes, for the sample log (nothing without one)."""
        if self._samples is not None:
            self._samples.observe(step, episodes)

    def add_text(self, tag: str, text: str, step: int) -> None:
        if self._tensorboard is not None:
            self._tensorboard.add_text(tensorboard_tag(tag), text, global_step=step)
            self._tensorboard.flush()

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
        if self._samples is not None:
            self._samples.close()
            self._samples = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
