"""The policy's section of the RLJob spec: its architecture, or the checkpoint it comes from.

Import the spec from ``stoker.spec``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_serializer, model_validator

from stoker.spec_base import SpecModel


class RopeScaling(SpecModel):
    """Rotary frequency rescaling for long contexts, as Hugging Face's ``rope_type`` names it.

    llama3 (Llama 3.1+): by wavelength band; high frequencies kept, low ones divided by
    ``factor``, a smooth blend between. linear (Gemma 3's global layers): all divided by ``factor``.
    """

    type: Literal["llama3", "linear"] = Field(description="llama3 | linear.")
    factor: float = Field(gt=0, description="How much longer the context is than the one trained on.")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: wavelengths above originalMaxPositionEmbeddings / this are scaled.")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: wavelengths below originalMaxPositionEmbeddings / this are kept.")
    original_max_position_embeddings: int = Field(8192, ge=1, description="llama3: the pre-extension context.")


class TransformerConfig(SpecModel):
    """Architecture of the decoder-only policy (Llama, Qwen2/3, Gemma 2/3 families; Qwen3-MoE and
    Mixtral mixtures of experts).

    With ``model.checkpoint`` set, this is read from the checkpoint's config.json; fields written
    in the manifest must then agree with it."""

    vocab_size: int = Field(64, ge=2, description="Tokenizer vocabulary size.")
    hidden_size: int = Field(64, ge=8, description="Width of the residual stream.")
    num_layers: int = Field(2, ge=1, description="Number of transformer blocks.")
    num_heads: int = Field(4, ge=1, description="Query heads per block.")
    num_kv_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention).")
    head_dim: int | None = Field(None, ge=4, description="Per-head width; hiddenSize/numHeads when unset.")
    intermediate_size: int = Field(128, ge=8, description="SwiGLU hidden width.")
    max_seq_len: int = Field(512, ge=16, description="Longest sequence the rotary tables cover.")
    rope_theta: float = Field(10000.0, gt=0, description="Rotary embedding base.")
    rms_norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon.")
    tie_embeddings: bool = Field(True, description="Share the input embedding with the output head.")
    attention_bias: bool = Field(False, description="Biases on the query/key/value projections (Qwen2).")
    qk_norm: bool = Field(False, description="RMSNorm on each query and key head before rotary (Qwen3, Gemma 3).")
    rope_scaling: RopeScaling | None = Field(None, description="Rotary frequency rescaling (global layers only).")
    mlp_activation: Literal["silu", "gelu-tanh"] = Field(
        "silu", description="Gate activation: silu (SwiGLU, Llama/Qwen) or gelu-tanh (GeGLU, Gemma)."
    )
    norm_unit_offset: bool = Field(False, description="RMSNorm scales by (1 + weight) (Gemma).")
    sandwich_norms: bool = Field(False, description="Also normalise the attention and MLP outputs (Gemma 2/3).")
    embedding_scale: bool = Field(False, description="Multiply token embeddings by sqrt(hiddenSize) (Gemma).")
    query_pre_attn_scalar: int | None = Field(
        None, ge=1, description="Scale queries by this^-1/2 instead of headDim^-1/2 (Gemma; an integer, as transformers declares it)."
    )
    attn_logit_softcap: float | None = Field(None, gt=0, description="cap * tanh(score / cap) on attention scores (Gemma 2).")
    final_logit_softcap: float | None = Field(None, gt=0, description="cap * tanh(logit / cap) on the output logits (Gemma 2).")
    sliding_window: int | None = Field(
        None, ge=1, description="Local layers see only the last slidingWindow tokens (the token itself included)."
    )
    global_layer_every: int | None = Field(
        None, ge=1, description="With slidingWindow: layer i is global iff (i + 1) % this == 0, the rest local (Gemma 2: 2, Gemma 3: 6)."
    )
    rope_local_theta: float | None = Field(None, gt=0, description="Rotary base of local layers; ropeTheta when unset (Gemma 3).")
    num_experts: int = Field(0, ge=0, description="Routed experts in each mixture-of-experts layer; 0: every layer dense.")
    num_experts_per_tok: int = Field(2, ge=1, description="Experts each token is routed to (top-k).")
    moe_intermediate_size: int | None = Field(
        None, ge=8, description="Each expert's SwiGLU hidden width; intermediateSize when unset (Mixtral)."
    )
    norm_topk_prob: bool = Field(
        True, description="Renormalise the top-k routing weights to sum to 1 (Mixtral always; Qwen3-MoE as configured)."
    )
    decoder_sparse_step: int = Field(
        1, ge=1, description="With numExperts: layer i is a mixture-of-experts layer iff (i + 1) % this == 0 (Qwen3-MoE)."
    )
    mlp_only_layers: tuple[int, ...] = Field(
        (), description="Layers that keep a dense MLP even where decoderSparseStep makes them sparse (Qwen3-MoE)."
    )
    router_aux_loss_coef: float = Field(
        0.0, ge=0, description="Weight of the router's load-balancing loss in training (with outputRouterLogits)."
    )
    output_router_logits: bool = Field(
        False, description="Train with the router's load-balancing loss (Hugging Face's switch for routerAuxLossCoef)."
    )

    @field_serializer("mlp_only_layers")
    def _as_list(self, layers: tuple[int, ...]) -> list[int]:
        # A tuple keeps the config hashable (programs are cached per config); manifests and the
        # CRD's schema see an array.
        return list(layers)

    @model_validator(mode="after")
    def _heads_divide(self) -> TransformerConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("numHeads must be a multiple of numKvHeads")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError("hiddenSize must be a multiple of numHeads when headDim is unset")
        if (self.sliding_window is None) != (self.global_layer_every is None):
            raise ValueError("slidingWindow and globalLayerEvery go together")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError("numExpertsPerTok must not exceed numExperts")
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(f"mlpOnlyLayers {list(self.mlp_only_layers)}: every index must be a layer (0..numLayers-1)")
        return self

    def is_local_layer(self, index: int) -> bool:
        """Whether layer ``index`` attends through the sliding window."""
        return self.global_layer_every is not None and (index + 1) % self.global_layer_every != 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` routes its tokens to experts (Qwen3-MoE's rule; Mixtral: every layer)."""
        return (
            self.num_experts > 0 and index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def expert_size(self) -> int:
        """Each expert's SwiGLU hidden width."""
        return self.moe_intermediate_size if self.moe_intermediate_size is not None else self.intermediate_size


# spec.model.remat: a policy, or auto (stoker.learner.remat picks one per device).
RematSetting = Literal["auto", "none", "full", "save-matmuls"]

LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _all_projections() -> list[LoraTarget]:
    return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraSpec(SpecModel):
    """Low-rank adapters (LoRA) on the named projections; the base weights stay frozen."""

    rank: int = Field(8, ge=1, le=1024, description="r: the adapters' inner dimension.")
    alpha: float = Field(16.0, gt=0, description="The update is scaled by alpha / rank.")
    targets: list[LoraTarget] = Field(
        default_factory=_all_projections,
        min_length=1,
        max_length=7,
        description="Projections that get an adapter, in every layer (Hugging Face's module names).",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input in training.")


class ModelSpec(SpecModel):
    """The policy: an architecture to initialise, or a Hugging Face-format checkpoint."""

    checkpoint: str | None = Field(
        None, description="Directory with safetensors weights and config.json; random init when unset."
    )
    tokenizer: str | None = Field(
        None,
        description=(
            "A tokenizers tokenizer.json, or a Hugging Face tokenizer directory (tokenizer_config.json and "
            "its chat template beside it); the checkpoint's own when unset, the environment's built-in "
            "without a checkpoint. 'builtin' pairs even a checkpoint with the built-in tokenizer."
        ),
    )
    chat_template: str | None = Field(
        None,
        description=(
            "A jinja chat template file for the opening and the turn wrapper; the tokenizer's own "
            "(tokenizer_config.json) when unset; 'none' for Stoker's plain turn format."
        ),
    )
    system_prompt: str | None = Field(None, description="System message rendered by the chat template.")
    architecture: TransformerConfig = Field(
        default_factory=TransformerConfig,
        description="Read from the checkpoint's config.json when checkpoint is set; fields given here must agree with it.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description=(
            "Compute dtype: the learner's forward and backward, the reference and the weights it publishes and "
            "the samplers run. The learner's own weights and Adam state are learner.weightDtype and "
            "learner.optimizerStateDtype (float32 by default)."
        ),
    )
    lora: LoraSpec | None = Field(
        None,
        description=(
            "Train low-rank adapters instead of every weight: the optimizer holds state for the adapters only; "
            "samplers and exports get the merged weights (stoker export also writes a PEFT adapter directory)."
        ),
    )
    remat: RematSetting = Field(
        "auto",
        description=(
            "Per-layer rematerialisation in the learner's step: full keeps only each layer's input and "
            "recomputes the rest in the backward pass; save-matmuls also keeps matmul outputs; none keeps all. "
            "auto: the first of none, save-matmuls, full whose step fits the accelerator with 10% of its memory "
            "free, from the compiler's memory analysis of the job's shapes (stoker plan says which); none on the CPU."
        ),
    )
    attention: Literal["auto", "blockwise", "xla", "cudnn", "splash"] = Field(
        "auto",
        description=(
            "Attention kernel of the learner's training forward: auto picks splash on a TPU, cuDNN on an "
            "NVIDIA GPU and blockwise elsewhere, falling back to blockwise where the model needs what the "
            "kernel lacks (cuDNN: bfloat16/float16, no soft-cap); blockwise (memory-efficient, anywhere); "
            "xla (jax.nn.dot_product_attention, dense scores); cudnn and splash are refused off their hardware."
        ),
    )
