"""The shape of a model: plain Python (no torch), so the config, the CLI and the planner load in milliseconds."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # the linear layers a LoRA adapter can target


@dataclass
class ModelArgs:
    """The shape of a Llama-family transformer."""

    dim: int = 256
    """Hidden size."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 8
    """Attention (query) heads."""
    n_kv_heads: int = 4
    """Key/value heads (grouped-query attention); must divide n_heads. Equal to n_heads for plain MHA."""
    vocab_size: int = 4096
    """Vocabulary size; must match the tokenizer of the data."""
    ffn_hidden_dim: int = 0
    """SwiGLU hidden size; 0 derives it Llama-style from dim, ffn_dim_multiplier and multiple_of."""
    ffn_dim_multiplier: float = 1.0
    """Scale of the derived SwiGLU hidden size (Llama 3 uses 1.3 for 8B, 1.2 for 405B)."""
    multiple_of: int = 64
    """The derived SwiGLU hidden size is rounded up to a multiple of this."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_scaling_factor: float = 0.0
    """Llama 3 RoPE frequency scaling factor (8.0 for Llama 3.1); 0 disables scaling."""
    rope_low_freq_factor: float = 1.0
    """Llama 3 RoPE scaling: low-frequency factor."""
    rope_high_freq_factor: float = 4.0
    """Llama 3 RoPE scaling: high-frequency factor."""
    rope_original_max_seq_len: int = 8192
    """Llama 3 RoPE scaling: context length of the original (unscaled) model."""
    max_seq_len: int = 1024
    """Longest sequence the model supports (size of the rotary table)."""
    tie_embeddings: bool = False
    """Share the input embedding matrix with the output projection."""
    sliding_window: int = 0
    """Sliding-window attention (Mistral, Qwen2): each token attends to itself and the sliding_window - 1
    tokens before it; 0 = full causal attention."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2); the output projection and MLP have none."""
    qk_norm: bool = False
    """RMSNorm of each query and key head (its own weight, head_dim wide) before the rotary embedding (Qwen3)."""
    attention_head_dim: int = 0
    """Size of each attention head; 0 = dim / n_heads (Qwen3 sets it apart: q_proj is n_heads x head_dim wide)."""
    moe_experts: int = 0
    """Mixture of experts: routed experts per MoE block; 0 = a dense model (every block one SwiGLU MLP)."""
    moe_top_k: int = 2
    """Experts each token is routed to (token-choice top-k)."""
    moe_hidden_dim: int = 0
    """Each expert's SwiGLU width; 0 = the dense width (hidden_dim)."""
    moe_shared_experts: int = 0
    """Shared experts every token passes through beside its routed ones (DeepSeek), as one SwiGLU of
    moe_shared_experts x moe_hidden_dim width; 0 = none (Mixtral, Qwen3-MoE)."""
    moe_dense_layers: int = 0
    """The first k blocks keep a dense MLP (DeepSeek-V3: 3); the rest are MoE blocks."""
    moe_score: str = "softmax"
    """Router scores: 'softmax' over the experts (Mixtral, Qwen3-MoE) or 'sigmoid' per expert (DeepSeek-V3)."""
    moe_norm_topk: bool = True
    """Renormalise each token's top-k weights to sum to 1 (Mixtral, Qwen3-MoE norm_topk_prob, DeepSeek-V3)."""
    moe_aux_loss: float = 0.0
    """Load-balancing loss coefficient (sequence-wise: E x sum_e f_e P_e per sequence, averaged, so it is the
    same whatever splits the batch); 0 = none."""
    moe_bias_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert's routing bias moves by this
    much towards balance (up if it got fewer tokens than the mean, down if more); the bias only picks experts,
    it never weights them. 0 = off."""

    retrieval_layers: str = ""
    """RETRO: the blocks (comma-separated indices, e.g. "1,3") that cross-attend, chunk by chunk, to the
    encoded neighbours retrieved for the chunk before (plait data retrieve); "" = no retrieval."""
    retrieval_chunk: int = 64
    """RETRO: tokens per chunk (the retrieval database's --chunk)."""
    retrieval_k: int = 2
    """RETRO: neighbours per chunk (at most the database's --k)."""
    retrieval_encoder_layers: int = 2
    """RETRO: bidirectional blocks of the neighbours' encoder (sharing the token embedding)."""
    retrieval_copy: bool = False
    """RETRO: also mix each token's next-token probability with the neighbours' unigram and bigram caches, two
    learned shares from 0 (plait.model.retrieval.NeighbourCopy): a copy from the neighbours that needs no
    learning."""
    retrieval_pointer: bool = False
    """RETRO: also let each token point into its neighbours and copy the token it points at, a learned attention
    of its own and a learned share per token from 0 (plait.model.retrieval.NeighbourPointer, a
    pointer-generator): a copy by content that the loss teaches where an answer sits in a passage."""
    retrieval_learned: bool = False
    """RETRO with the pointer: a retriever that learns (REALM; plait.model.retrieval_learned). The neighbours are
    found with a trainable encoder that starts as the database's lexical one, the pointer's likelihood is
    marginalised over them, and the index is refreshed from the encoder every retrieval_refresh_steps in the
    background."""
    retrieval_dim: int = 512
    """The learned retriever's embedding size: the lexical database's --dim, which it starts from."""
    retrieval_refresh_steps: int = 50
    """The learned retriever's index is rebuilt from its encoder every this many steps, in the background; the
    steps in between search the last one built."""

    def neighbour_encoder_args(self) -> ModelArgs:
        """RETRO's neighbour encoder's blocks: this model's, dense, full attention, no cross-attention of their
        own (the one shape rule of the model's encoder and of the planner's counts)."""
        return replace(self, sliding_window=0, moe_experts=0, retrieval_layers="")

    @property
    def retrieval_ids(self) -> tuple[int, ...]:
        """The blocks with chunked cross-attention (retrieval_layers as numbers)."""
        return tuple(sorted({int(x) for x in self.retrieval_layers.split(",") if x.strip()}))

    @property
    def learns_retriever(self) -> bool:
        """Whether the model has a learned retriever (plait.model.retrieval_learned): retrieval, the pointer it
        lives in, and retrieval_learned; the one rule of the model, its counts and the planner's."""
        return bool(self.retrieval_ids) and self.retrieval_pointer and self.retrieval_learned

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden_dim:
            return self.ffn_hidden_dim
        hidden = int(self.ffn_dim_multiplier * int(2 * 4 * self.dim / 3))
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def expert_hidden_dim(self) -> int:
        return self.moe_hidden_dim or self.hidden_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block layer_id is a mixture of experts (else a dense SwiGLU MLP)."""
        return self.moe_experts > 0 and layer_id >= self.moe_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def _mlp_params(self, moe: bool, active: bool) -> int:
        if not moe:
            return 3 * self.dim * self.hidden_dim
        experts = self.moe_top_k if active else self.moe_experts
        routed = (experts + self.moe_shared_experts) * 3 * self.dim * self.expert_hidden_dim
        return routed + self.dim * self.moe_experts  # + the router

    def num_params(self, *, exclude_embeddings: bool = False, active: bool = False) -> int:
        """Parameter count computed from the shape (no model needed: the planner uses it for 405B). active:
        what one token uses (an MoE block's top-k and shared experts, not all of them)."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.dim * q_dim * 2 + self.dim * kv_dim * 2
        if self.qkv_bias:
            attn += q_dim + 2 * kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlps = sum(self._mlp_params(self.is_moe_layer(i), active) for i in range(self.n_layers))
        embed = self.vocab_size * self.dim
        output = 0 if self.tie_embeddings else self.vocab_size * self.dim
        total = self.n_layers * (attn + 2 * self.dim) + mlps + self.dim + embed + output
        if self.retrieval_ids:  # chunked cross-attention (its projections, norm and gate), the neighbours' encoder
            cross = self.dim * q_dim * 2 + self.dim * kv_dim * 2 + self.dim + 1
            encoder = self.retrieval_encoder_layers * (attn + 2 * self.dim + 3 * self.dim * self.hidden_dim)
            total += len(self.retrieval_ids) * cross + encoder + self.dim + (2 if self.retrieval_copy else 0)
            total += (2 * self.dim * self.head_dim + self.dim + 3) if self.retrieval_pointer else 0
            total += (self.vocab_size * self.retrieval_dim + 1) if self.learns_retriever else 0
        return total - (embed if exclude_embeddings else 0)

    def matmul_params(self) -> float:
        """Weights of one block that take part in a token's matmuls (everything but its norm vectors and
        biases; of an MoE block, the router and the top-k and shared experts), averaged over the blocks."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        total = sum(self._mlp_params(self.is_moe_layer(i), True) for i in range(self.n_layers))
        mlps = total // self.n_layers if total % self.n_layers == 0 else total / self.n_layers
        return self.dim * (2 * q + 2 * kv) + mlps

    def layer_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs of one block per token: 2 per matmul weight, plus attention 4 h s with h the
        attention's width, heads x head size (QK^T and AV over the full s x s square: the convention of MFU
        reports, PaLM's 12 L H Q T over forward and backward; causal kernels skip half at lower efficiency).
        h is the model's width for Llama; Qwen3's heads are wider (32 x 128 = 4,096 beside 2,048)."""
        return 2 * self.matmul_params() + 4 * self.n_heads * self.head_dim * seq_len

    def head_flops_per_token(self) -> float:
        """Forward FLOPs of the output projection per token (the embedding lookup is free)."""
        return 2 * self.dim * self.vocab_size

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward): 6 N over the matmul weights (the output
        projection included, tied or not) plus attention 12 L h s (h: heads x head size), the PaLM / Megatron
        estimate for a causal model without discounting the mask. The one FLOPs rule: MFU in training, bench
        and the planner."""
        return 3 * (
            self.n_layers * self.layer_flops_per_token(seq_len)
            + self.head_flops_per_token()
            + self.retrieval_flops_per_token()
        )

    def retrieval_flops_per_token(self, weights_only: bool = False) -> float:
        """Forward FLOPs of RETRO's parts per token of the sequence: each chunk of c tokens brings k neighbours
        of 2c tokens (2k encoder tokens per sequence token, each through the encoder's blocks: 2 per matmul
        weight and 4 h (2c) for bidirectional attention over 2c tokens, h = heads x head size), and each
        cross-attending block projects them to keys and values (2k tokens x 2 kv projections) beside the token's
        own query and output projections and its attention over k 2c keys. weights_only: the matmuls with weights alone
        (as many FLOPs as their weight gradients take in backward)."""
        if not self.retrieval_ids:
            return 0.0
        if weights_only:
            q, kv, k = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.retrieval_k
            dense = self.dim * (2 * q + 2 * kv) + 3 * self.dim * self.hidden_dim
            cross = 2 * (2 * self.dim * q) + 2 * k * 2 * (2 * self.dim * kv)
            pointer = (2 * self.dim * self.head_dim * (1 + 2 * k) + 2 * self.dim) if self.retrieval_pointer else 0
            return 2 * k * self.retrieval_encoder_layers * 2 * dense + len(self.retrieval_ids) * cross + pointer
        q, kv, c, k = (
            self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
            self.retrieval_chunk,
            self.retrieval_k,
        )
        dense = self.dim * (2 * q + 2 * kv) + 3 * self.dim * self.hidden_dim
        encoder = 2 * k * self.retrieval_encoder_layers * (2 * dense + 4 * q * 2 * c)
        cross = 2 * (2 * self.dim * q) + 2 * k * 2 * (2 * self.dim * kv) + 4 * q * k * 2 * c
        # model.retrieval_pointer: its query and switch per token, its keys per neighbour token, its scores
        pointer = 2 * self.dim * self.head_dim * (1 + 2 * k) + 2 * self.dim + 2 * self.head_dim * k * 2 * c
        # model.retrieval_learned: each chunk's and its neighbours' bags of table rows (c adds of d each), per token
        pointer += 2 * (1 + k) * self.retrieval_dim if self.learns_retriever else 0
        return encoder + len(self.retrieval_ids) * cross + (pointer if self.retrieval_pointer else 0)


def recompute_units_pay(dim, hidden_dim, tp):
    """Whether selective recompute keeps less as two units per block (each half up to its output projection:
    the projections keep their inputs, (dim + hidden_dim) / tp per token) than as one (the projections'
    outputs kept instead: 2 dim, full-size partial sums under tensor parallelism). With Llama's hidden_dim
    = 8/3 dim: from tp = 2 on. The one rule for the runtime (parallel.activation_checkpoint.apply_ac) and the
    planner; works on numpy arrays of tp."""
    return 2 * dim * tp > dim + hidden_dim


def split_layers(args: ModelArgs, num_stages: int, how: str = "cost", seq_len: int = 0) -> list[list[int]]:
    """Consecutive layer ids per pipeline stage. 'layers': counts as equal as possible. 'cost': balance the
    training FLOPs (ModelArgs.layer_flops_per_token at seq_len, default max_seq_len), the output projection
    counted on the last stage; the embedding lookup is nearly free. The one stage-split rule: the pipeline
    builds these stages and the planner sizes each rank's memory and time from them."""
    n = args.n_layers
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} pipeline stages")
    if how == "layers":
        bounds = [round(i * n / num_stages) for i in range(num_stages + 1)]
        return [list(range(bounds[i], bounds[i + 1])) for i in range(num_stages)]
    extra_last = args.head_flops_per_token() / args.layer_flops_per_token(seq_len or args.max_seq_len)
    # Per-stage layer counts (each >= 1) minimising the largest stage cost; the last stage pays extra.
    others = num_stages - 1
    best: tuple[float, int] | None = None  # (the largest stage cost, the last stage's layers)
    for last in range(1, n - num_stages + 2) if others else [n]:
        rest = n - last
        if rest < others:
            continue
        largest_other = -(-rest // others) if others else 0  # the other stages split the rest evenly
        worst = max(largest_other, last + extra_last)
        if best is None or worst < best[0] - 1e-9:
            best = (worst, last)
    assert best is not None
    last = best[1]
    base, extra = divmod(n - last, others) if others else (0, 0)
    counts = [base + (1 if i < extra else 0) for i in range(others)] + [last]
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [list(range(s, s + c)) for s, c in zip(starts, counts, strict=True)]


LOGITS_PER_CHUNK = 1 << 28
"""Logits (tokens x vocabulary entries of this rank) per chunk when train.loss_chunk_tokens is 0: 268 M, so one
chunk's logits are 512 MiB in bf16 (1 GiB for each fp32 temporary of the eager path; the compiled kernels keep
fp32 in registers); llama3-1b: 2,048 tokens a chunk, 4 chunks for 4 x 2,048 tokens. Not smaller: the weight
gradient (V x dim, fp32) is read and written once per chunk, and with short chunks that traffic outweighs
the weight-gradient matmul itself (at 256 tokens a chunk, 32 passes over 1 GiB for llama3-1b). The planner
sizes the head's transient memory with the same rule."""


def chunk_tokens(num_tokens: int, vocab_local: int, requested: int = 0) -> int:
    """Tokens per chunk of the fused head: `requested` (train.loss_chunk_tokens) if set, else as many as keep a
    chunk's logits near LOGITS_PER_CHUNK, in equal chunks (the last one may be shorter)."""
    if requested > 0:
        return min(requested, num_tokens)
    chunks = max(1, math.ceil(num_tokens * vocab_local / LOGITS_PER_CHUNK))
    return math.ceil(num_tokens / chunks)
