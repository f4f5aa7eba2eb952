"""The RLJob spec's cross-field rules (``cross_field_problems``, ``name_problems``) and their CEL
twins for the CRD (``CEL_RULES``, ``ROOT_CEL_RULES``); the rollout tier's own are in
``stoker.spec_rollout``.

Import them from ``stoker.spec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stoker import spec_cel
from stoker.jobname import name_problems as _name_problems
from stoker.jobname import rollout_name_problems as _rollout_name_problems
from stoker.spec_cel import cel
from stoker.spec_learner import (
    MAX_SEQUENCE_BUCKETS, MIN_BF16_WEIGHTS_LEARNING_RATE, AlgorithmName, AlgorithmSpec, BufferSpec, LearnerSpec,
)
from stoker.spec_model import TransformerConfig
from stoker.spec_rollout import ROLLOUT_CEL_RULES, ROLLOUT_NAME_CEL_RULE, rollout_hosts, rollout_problems
from stoker.tpu import TopologyError, hosts_per_slice

if TYPE_CHECKING:  # for annotations only: stoker.spec imports this module
    from stoker.spec import RLJobSpec


def cross_field_problems(spec: RLJobSpec) -> list[tuple[str, str]]:
    """Rules spanning several fields, as ``(field path under spec, message)``.

    Kept as plain checks rather than pydantic validators so each problem names the exact field;
    the CRD carries the same rules as CEL (see ``stoker.crd``) so the API server enforces them too.
    """
    problems: list[tuple[str, str]] = []
    actors = spec.actors
    if actors.min_replicas > actors.max_replicas:
        problems.append(
            ("actors.minReplicas", f"got {actors.min_replicas}; expected <= maxReplicas ({actors.max_replicas})")
        )
    if spec.learner.accelerator != "cpu" and spec.learner.topology is None:
        problems.append(("learner.topology", f"missing; required for accelerator {spec.learner.accelerator}"))
    if spec.algorithm.name in (AlgorithmName.GRPO, AlgorithmName.GSPO) and spec.buffer.group_size < 2:
        problems.append(
            ("buffer.groupSize", f"got {spec.buffer.group_size}; expected >= 2 for group-relative advantages")
        )
    if spec.buffer.capacity < spec.buffer.group_size:
        problems.append(
            ("buffer.capacity", f"got {spec.buffer.capacity}; expected >= buffer.groupSize ({spec.buffer.group_size}): "
                                "a full buffer must hold a complete group")
        )
    if spec.algorithm.off_policy_correction in LOSS_ONLY_CORRECTIONS and spec.algorithm.name not in (
        AlgorithmName.GRPO, AlgorithmName.PPO
    ):
        problems.append(
            ("algorithm.offPolicyCorrection", f"got {spec.algorithm.off_policy_correction}; expected clip, decoupled or "
                                              f"none for {spec.algorithm.name} (episode, lag-clip and m2po: grpo and ppo)")
        )
    if spec.algorithm.name == AlgorithmName.SFT and spec.algorithm.sft is None:
        problems.append(("algorithm.sft", "missing; algorithm.name sft trains on algorithm.sft.dataset"))
    if spec.algorithm.name == AlgorithmName.SFT and spec.mode == "colocated":
        problems.append(("mode", "colocated with algorithm.name sft; expected disaggregated (SFT plays no episodes)"))
    if spec.algorithm.name == AlgorithmName.DISTILL and spec.algorithm.teacher is None:
        problems.append(("algorithm.teacher", "missing; algorithm.name distill needs algorithm.teacher.checkpoint"))
    longest_bucket = spec.learner.sequence_buckets[-1]
    if longest_bucket > spec.model.architecture.max_seq_len:
        problems.append(
            (
                "learner.sequenceBuckets",
                f"got a {longest_bucket}-token bucket; expected <= model.architecture.maxSeqLen "
                f"({spec.model.architecture.max_seq_len})",
            )
        )
    if spec.learner.accelerator != "cpu" and spec.learner.topology is not None:
        try:
            hosts_per_slice(spec.learner.accelerator, spec.learner.topology)
        except TopologyError as exc:
            problems.append(("learner.topology", str(exc)))
    if spec.environment.name == "frozenlake":
        seeds = [task for task in spec.environment.eval_tasks if not task.isascii() or not task.isdigit()]
        if seeds:
            problems.append(("environment.evalTasks", f"got {seeds[:3]}; expected FrozenLake map seeds (non-negative integers)"))
    if spec.mode == "colocated" and spec.learner.service_account_name is not None:
        problems.append(
            ("learner.serviceAccountName", "set in colocated mode; expected unset (the learner runs as the sandbox manager)")
        )
    if spec.mode == "colocated" and (hosts := _learner_hosts(spec)) > 1:
        problems.append(
            ("mode", f"colocated with a learner of {hosts} hosts; expected one host (the colocated learner plays its "
                     "episodes in one process) or mode: disaggregated")
        )
    if spec.learner.weight_dtype != "float32" and spec.model.lora is not None:
        problems.append(
            ("learner.weightDtype", f"got {spec.learner.weight_dtype} with model.lora; expected float32 (LoRA trains "
                                    "float32 adapters on a base frozen in model.dtype)")
        )
    elif spec.learner.weight_dtype == "bfloat16" and spec.algorithm.learning_rate < MIN_BF16_WEIGHTS_LEARNING_RATE:
        problems.append(
            ("learner.weightDtype", f"bfloat16 with learningRate {spec.algorithm.learning_rate:g}; expected float32: "
                                    f"bfloat16 weights lose every update below ~|w| x 2^-9, nearly all of them below "
                                    f"learningRate {MIN_BF16_WEIGHTS_LEARNING_RATE:g}")
        )
    ep, experts = spec.learner.mesh.ep, spec.model.architecture.num_experts
    if ep > 1 and (not experts or experts % ep):
        problems.append(
            ("learner.mesh.ep", f"got {ep}; expected a divisor of model.architecture.numExperts ({experts}): each device "
                                "holds numExperts/ep whole experts" + ("" if experts else " (this model has none)"))
        )
    volume = spec.learner.weights_volume
    if volume is not None and (volume.gcs_bucket is None) == (volume.persistent_volume_claim is None):
        problems.append(
            ("learner.weightsVolume", "expected exactly one of gcsBucket and persistentVolumeClaim")
        )
    if spec.rollout is not None:
        problems += rollout_problems(spec)
    return problems


def _learner_hosts(spec: RLJobSpec) -> int:
    """The learner's processes: every host of every slice (1 per slice for a bad topology, which
    is reported on its own)."""
    learner = spec.learner
    if learner.accelerator == "cpu" or learner.topology is None:
        return learner.num_slices
    try:
        return hosts_per_slice(learner.accelerator, learner.topology) * learner.num_slices
    except TopologyError:
        return learner.num_slices


def name_problems(name: str, spec: RLJobSpec) -> list[str]:
    """Why ``name`` cannot name an RLJob with this spec: its learner's pod names must stay DNS labels."""
    try:
        hosts = hosts_per_slice(spec.learner.accelerator, spec.learner.topology)
    except TopologyError:
        hosts = 1  # the topology is reported on its own; check what holds for any shape
    problems = _name_problems(name, spec.learner.num_slices, hosts)
    if spec.rollout is not None and rollout_hosts(spec.rollout) > 1:
        problems += _rollout_name_problems(name, spec.rollout.max_replicas, rollout_hosts(spec.rollout))
    return problems


# CEL equivalents of cross_field_problems (and of the sections' model validators), attached to the
# CRD schema at these paths; tests/core/test_cel.py runs both on one table of cases.
_ROOT_ACCELERATOR = spec_cel.opt("self", ("spec", "learner", "accelerator"), "'cpu'")
_ROOT_TOPOLOGY = spec_cel.opt("self", ("spec", "learner", "topology"), "''")
_ROOT_SLICES = spec_cel.opt("self", ("spec", "learner", "numSlices"), "1")
_ROOT_MODE = spec_cel.opt("self", ("spec", "mode"), "'disaggregated'")
_ROOT_LEARNER_IMAGE = spec_cel.opt("self", ("spec", "learner", "image"), "''")
_LEARNER = "self.spec.learner"
_ROOT_HAS_TPU = f"has(self.spec) && has({_LEARNER}) && has({_LEARNER}.topology) && {_LEARNER}.accelerator != 'cpu'"



def _old(expression: str) -> str:
    return expression.replace("self.", "oldSelf.").replace("has(self)", "has(oldSelf)")


_ALGORITHM = spec_cel.opt("self", ("algorithm", "name"), "'grpo'")
_GROUP_SIZE = spec_cel.opt("self", ("buffer", "groupSize"), str(BufferSpec().group_size))
_CAPACITY = spec_cel.opt("self", ("buffer", "capacity"), str(BufferSpec().capacity))
_BUCKETS = spec_cel.opt("self", ("learner", "sequenceBuckets"), str(LearnerSpec().sequence_buckets))
_MAX_SEQ_LEN = spec_cel.opt("self", ("model", "architecture", "maxSeqLen"), str(TransformerConfig().max_seq_len))
_WEIGHT_DTYPE = spec_cel.opt("self", ("learner", "weightDtype"), "'float32'")
_EP = spec_cel.opt("self", ("learner", "mesh", "ep"), "1")
_EXPERTS = spec_cel.opt("self", ("model", "architecture", "numExperts"), "0")
_CORRECTION = spec_cel.opt("self", ("algorithm", "offPolicyCorrection"), "'clip'")
# Corrections that are the token-level policy-gradient loss's alone (GRPO's, PPO's).
LOSS_ONLY_CORRECTIONS = ("episode", "lag-clip", "m2po")
_LEARNING_RATE = spec_cel.opt("self", ("algorithm", "learningRate"), repr(float(AlgorithmSpec().learning_rate)))

ROOT_CEL_RULES: list[dict[str, Any]] = [
    cel(
        f"!has(self.metadata.name) || ({_ROOT_HAS_TPU} ? "
        + spec_cel.name_fits("self.metadata.name", f"{_LEARNER}.numSlices", spec_cel.hosts(f"{_LEARNER}.accelerator", f"{_LEARNER}.topology"))
        + " : "
        + spec_cel.name_fits("self.metadata.name", _ROOT_SLICES, "1")
        + ")",
        "metadata.name is too long: the learner's pod names (<name>-learner-slice-<slice>-<host>-<5 characters>) "
        "must stay at most 63 characters (stoker validate says the limit)",
    ),
    cel("!has(self.metadata.name) || self.metadata.name.matches('^[a-z]')", "metadata.name must start with a letter"),
    cel(f"{_ROOT_MODE} == {_old(_ROOT_MODE)}", "spec.mode is immutable"),
    cel(f"{_ROOT_ACCELERATOR} == {_old(_ROOT_ACCELERATOR)}", "spec.learner.accelerator is immutable"),
    cel(f"{_old(_ROOT_TOPOLOGY)} == '' || {_ROOT_TOPOLOGY} == {_old(_ROOT_TOPOLOGY)}", "spec.learner.topology is immutable once set"),
    cel(f"{_ROOT_SLICES} == {_old(_ROOT_SLICES)}", "spec.learner.numSlices is immutable"),
    # The learner's JobSet (or Jobs) is created once and never patched: an edited image would be
    # admitted and never run.
    cel(f"{_ROOT_LEARNER_IMAGE} == {_old(_ROOT_LEARNER_IMAGE)}", "spec.learner.image is immutable"),
    ROLLOUT_NAME_CEL_RULE,
]

CEL_RULES: dict[tuple[str, ...], list[dict[str, Any]]] = {
    (): [
        cel(
            f"!({_ALGORITHM} in ['grpo', 'gspo'] && {_GROUP_SIZE} < 2)",
            "buffer.groupSize must be >= 2 for grpo and gspo (group-relative advantages)",
        ),
        cel(
            f"!({_CORRECTION} in {list(LOSS_ONLY_CORRECTIONS)} && !({_ALGORITHM} in ['grpo', 'ppo']))",
            "algorithm.offPolicyCorrection episode, lag-clip and m2po are for algorithm.name grpo and ppo",
        ),
        cel(f"{_CAPACITY} >= {_GROUP_SIZE}", "buffer.capacity must be >= buffer.groupSize (a full buffer must hold a complete group)"),
        cel(
            f"{_ALGORITHM} != 'sft' || (has(self.algorithm) && has(self.algorithm.sft))",
            "algorithm.sft (its dataset) is required for algorithm.name sft",
        ),
        cel(
            f"{_ALGORITHM} != 'distill' || (has(self.algorithm) && has(self.algorithm.teacher))",
            "algorithm.teacher (its checkpoint) is required for algorithm.name distill",
        ),
        cel(
            f"!({_ALGORITHM} == 'sft' && {spec_cel.opt('self', ('mode',), repr('disaggregated'))} == 'colocated')",
            "algorithm.name sft plays no episodes: it needs mode disaggregated",
        ),
        cel(
            f"{_BUCKETS}[{_BUCKETS}.size() - 1] <= {_MAX_SEQ_LEN}",
            "learner.sequenceBuckets must not exceed model.architecture.maxSeqLen",
        ),
        cel(
            f"{_EP} == 1 || ({_EXPERTS} > 0 && {_EXPERTS} % {_EP} == 0)",
            "learner.mesh.ep must divide model.architecture.numExperts (each device holds numExperts/ep whole experts)",
        ),
        cel(
            f"{_WEIGHT_DTYPE} == 'float32' || !(has(self.model) && has(self.model.lora))",
            "learner.weightDtype must be float32 with model.lora (LoRA trains float32 adapters)",
        ),
        cel(
            f"!({_WEIGHT_DTYPE} == 'bfloat16' && {_LEARNING_RATE} < {MIN_BF16_WEIGHTS_LEARNING_RATE:.8f})",
            f"learner.weightDtype bfloat16 needs algorithm.learningRate >= {MIN_BF16_WEIGHTS_LEARNING_RATE:g}: "
            "bfloat16 weights lose smaller updates",
        ),
        cel(
            f"!({spec_cel.opt('self', ('mode',), repr('disaggregated'))} == 'colocated'"
            " && has(self.learner) && has(self.learner.serviceAccountName))",
            "learner.serviceAccountName is for disaggregated mode (a colocated learner runs as the sandbox manager)",
        ),
        cel(
            f"!({spec_cel.opt('self', ('mode',), repr('disaggregated'))} == 'colocated' && has(self.rollout))",
            "rollout is for disaggregated mode (a colocated learner generates on its own mesh)",
        ),
        cel(
            f"!({spec_cel.opt('self', ('mode',), repr('disaggregated'))} == 'colocated' && has(self.learner)"
            " && ((has(self.learner.numSlices) && self.learner.numSlices > 1)"
            " || (has(self.learner.accelerator) && self.learner.accelerator != 'cpu' && has(self.learner.topology)"
            f" && {spec_cel.hosts('self.learner.accelerator', 'self.learner.topology')} > 1)))",
            "mode: colocated runs the learner on one host (it plays its episodes in one process); a learner of "
            "several hosts or slices needs mode: disaggregated",
        ),
    ],
    ("learner", "weightsVolume"): [
        cel("has(self.gcsBucket) != has(self.persistentVolumeClaim)", "expected exactly one of gcsBucket and persistentVolumeClaim")
    ],
    ("rollout",): ROLLOUT_CEL_RULES,
    ("actors",): [cel("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas")],
    ("environment",): [
        cel(
            f"{spec_cel.opt('self', ('name',), repr('frozenlake'))} != 'frozenlake' || !has(self.evalTasks)"
            " || self.evalTasks.all(t, t.matches('^[0-9]+$'))",
            "evalTasks of frozenlake must be map seeds (non-negative integers)",
        )
    ],
    ("model", "architecture"): [
        cel("self.numHeads % self.numKvHeads == 0", "numHeads must be a multiple of numKvHeads"),
        cel("has(self.headDim) || self.hiddenSize % self.numHeads == 0", "hiddenSize must be a multiple of numHeads when headDim is unset"),
    ],
    ("learner",): [
        cel("self.accelerator == 'cpu' || has(self.topology)", "topology is required for a TPU accelerator"),
        cel(
            "self.accelerator == 'cpu' || !has(self.topology) || " + spec_cel.valid_topology("self.accelerator", "self.topology"),
            "topology is not one this accelerator has (stoker validate names the ones it has)",
        ),
        cel(
            "!has(self.sequenceBuckets) || self.sequenceBuckets[0] >= 8 && "
            + spec_cel.strictly_ascending("self.sequenceBuckets", MAX_SEQUENCE_BUCKETS),
            "sequenceBuckets must be strictly ascending lengths >= 8",
        ),
    ],
}
