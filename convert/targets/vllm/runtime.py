"""The export in transformers as vLLM computes it: the latent norm's eps (`match_vllm_norms`), and one
layer's export attention standing in a source decoder layer (`ExportAttention`)."""

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from convert.targets.vllm.geometry import KV_LORA_RANK, LATENT_DIMS
from convert.targets.vllm.nope_fit import additive_mask


class ExportAttention(torch.nn.Module):
    """The export's DeepseekV3Attention standing in a source decoder layer's self_attn: its own
    rotary embedding (the export's 64 interleaved dims), the latent norm's eps as vLLM reads it,
    its output ÷ s (o_proj carries the residual scale; the source's stream is unscaled)."""

    def __init__(self, export_config: dict, layer: int, tensors: dict[str, torch.Tensor], s: float):
        super().__init__()
        config = DeepseekV3Config.from_dict({k: v for k, v in export_config.items() if k != "convert_export"})
        config._attn_implementation = "eager"
        self.attention = DeepseekV3Attention(config, layer).to(torch.float32)
        weights = {name: t.float() for name, t in tensors.items()}
        weights["o_proj.weight"] = weights["o_proj.weight"] / s
        self.attention.load_state_dict(weights)
        _match_vllm_norm(self.attention, config.rms_norm_eps)
        self.rotary = DeepseekV3RotaryEmbedding(config)
        # what vLLM never reads is not refined (`convert.compress.refine`)
        self.untrained_parameters = tuple(name.removeprefix("self_attn.") for name in VLLM_SKIPS)

    def export_tensors(self, s: float) -> dict[str, torch.Tensor]:
        """The attention's tensors as the export writes them (o_proj × s again)."""
        tensors = {name: t.detach().clone() for name, t in self.attention.state_dict().items()}
        tensors["o_proj.weight"] = tensors["o_proj.weight"] * s
        return tensors

    def forward(
        self, hidden_states, attention_mask=None, position_ids=None, key_states=None, key_position_ids=None, **kwargs
    ):
        """The attention of `hidden_states` (B, L, D) at `position_ids` (B|1, L; None: 0..L-1). key_states
        (B, S, D) at `key_position_ids` (B|1, S; None: 0..S-1): the hidden states the keys and values come
        from, where they are not the queries' (some positions' queries against a whole window, as
        `convert.compress.refine` steps; `attention_mask` (…, L, S) then says which keys each query sees)."""
        L = hidden_states.shape[1]
        if position_ids is None:
            position_ids = torch.arange(L, device=hidden_states.device)[None]
        rotary = self.rotary(hidden_states, position_ids)
        if key_states is None:
            mask = additive_mask(attention_mask, L, hidden_states.dtype)
            return self.attention(hidden_states, position_embeddings=rotary, attention_mask=mask)
        S = key_states.shape[1]
        if key_position_ids is None:
            key_position_ids = torch.arange(S, device=key_states.device)[None]
        mask = additive_mask(attention_mask, L, hidden_states.dtype, keys=S)  # (…, L, S)
        keyed = keyed_attention(
            self.attention, hidden_states, key_states, rotary, self.rotary(key_states, key_position_ids), mask
        )
        return keyed, None


def keyed_attention(attention, hidden_states, key_states, rotary, key_rotary, mask) -> torch.Tensor:
    """transformers' DeepseekV3Attention (eager, no cache) with the queries from `hidden_states` (B, L, D)
    turned by `rotary` and the keys and values from `key_states` (B, S, D) turned by `key_rotary`, under the
    additive `mask` (…, L, S): the output (B, L, D). At key_states = hidden_states it is the module's own."""
    B, L = hidden_states.shape[:2]
    S = key_states.shape[1]
    if attention.q_lora_rank is None:
        q = attention.q_proj(hidden_states)
    else:
        q = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(hidden_states)))
    q = q.view(B, L, -1, attention.qk_head_dim).transpose(1, 2)  # (B, H, L, e)
    q_pass, q_rot = torch.split(q, [attention.qk_nope_head_dim, attention.qk_rope_head_dim], dim=-1)
    latent = attention.kv_a_proj_with_mqa(key_states)  # (B, S, r + rope)
    kv_nope, k_rot = torch.split(latent, [attention.kv_lora_rank, attention.qk_rope_head_dim], dim=-1)
    kv_nope = attention.kv_a_layernorm(kv_nope).view(B, 1, S, attention.kv_lora_rank)
    k_rot = k_rot.view(B, 1, S, attention.qk_rope_head_dim)
    turn = (
        modeling_deepseek_v3.apply_rotary_pos_emb_interleave
        if attention.config.rope_interleave
        else modeling_deepseek_v3.apply_rotary_pos_emb
    )
    q_rot = turn(q_rot, q_rot, *rotary)[0]
    k_rot = turn(k_rot, k_rot, *key_rotary)[1]
    keys, values = attention.expand_kv(kv_nope, k_rot)  # (B, H, S, e), (B, H, S, v)
    output, _ = modeling_deepseek_v3.eager_attention_forward(
        attention, torch.cat((q_pass, q_rot), dim=-1), keys, values, mask, scaling=attention.scaling
    )  # (B, L, H, v)
    return attention.o_proj(output.reshape(B, L, -1))


#: Tensors of an export vLLM never reads (its attention Linears have no biases): healing leaves them.
VLLM_SKIPS = ("self_attn.kv_a_proj_with_mqa.bias", "self_attn.o_proj.bias")


def match_vllm_norms(model) -> None:
    """Make transformers' DeepseekV3 compute what vLLM does on an export of this target.

    transformers hard-codes `kv_a_layernorm`'s eps to 1e-6; vLLM uses `rms_norm_eps` (2^40 here).
    An export carries the difference itself (`NORM_ROWS`: a latent bias transformers reads and vLLM
    skips), so stock transformers needs nothing and this leaves it alone; on an export written
    before that (no `kv_a_proj_with_mqa.bias`) it sets the eps to the config's. Also marks the
    attention biases vLLM skips as not to be trained (`convert.healing`)."""
    for layer in model.model.layers:
        _match_vllm_norm(layer.self_attn, model.config.rms_norm_eps)
    model.untrained_parameters = VLLM_SKIPS


def _match_vllm_norm(attention: DeepseekV3Attention, eps: float) -> None:
    """A DeepseekV3Attention's latent norm as vLLM computes it: as it is with the latent bias
    (`NORM_ROWS`), else with its eps (transformers names it variance_epsilon) set to `eps`. With the
    bias, training leaves the norm rows' weights at zero (`_hold_norm_rows`, where the weight is
    trainable now; not through adapters such as LoRA's, which train their own matrices)."""
    projection = attention.kv_a_proj_with_mqa
    if getattr(projection, "bias", None) is not None:
        if projection.weight.requires_grad:  # torch takes no hook on a tensor without gradient
            projection.weight.register_hook(_hold_norm_rows)
        return
    norm = attention.kv_a_layernorm
    setattr(norm, "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps", eps)


def _hold_norm_rows(grad: torch.Tensor) -> torch.Tensor:
    """kv_a_proj_with_mqa.weight's gradient without its `NORM_ROWS` rows. In transformers those rows
    are NORM_BIAS + w·x, whose square in the norm's mean has a gradient 2·NORM_BIAS·x in w: a path vLLM,
    which reads no bias, does not have. Held at zero they stay what vLLM computes (and what llama.cpp's
    file, cut to the used dims, drops)."""
    grad = grad.clone()
    grad[LATENT_DIMS:KV_LORA_RANK] = 0
    return grad


# ------------------------------------------------------------------ the target's interface (convert.targets)
