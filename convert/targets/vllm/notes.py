"""What the vllm target says of an export: the report's section, its paragraph and the summary's line."""

import torch

from convert.io.reader import dtype_itemsize

NAME = "vllm"


def report(export: dict, e2e: dict | None, ckpt_dtype: torch.dtype) -> dict:
    """The report's section: the cache in vLLM against the original's, and where it is lossy."""
    size = dtype_itemsize(ckpt_dtype)
    layers = len(export["rotary_key_energy_kept"])
    return {
        "name": NAME,
        "exact": export["exact"],
        "cache_values_per_token_per_layer": export["kv_cache_dims_per_token_per_layer"],
        "gqa_cache_values_per_token_per_layer": export["gqa_cache_dims_per_token_per_layer"],
        "cache_bytes_per_token": export["kv_cache_dims_per_token_per_layer"] * size * layers,
        "gqa_cache_bytes_per_token": export["gqa_cache_dims_per_token_per_layer"] * size * layers,
        "perplexity_ratio": (e2e or {}).get("ppl_ratio"),
        "note": note(export),
    }


def short_note(info: dict) -> str:
    """What the vllm target keeps and loses, in one line that says what to do (the summary's note;
    the report has the whole paragraph, `note`)."""
    cache, gqa = info["kv_cache_dims_per_token_per_layer"], info["gqa_cache_dims_per_token_per_layer"]
    size = (
        f"{cache} cached values per token and layer, more than this model's GQA cache ({gqa}): MLA saves memory "
        "from ~7B on"
        if cache > gqa
        else f"{cache} cached values per token and layer (GQA: {gqa})"
    )
    if info["exact"]:
        return f"for vLLM: exact; {size}"
    biases = info.get("attention_biases")
    carried = f"; q/k/v biases carried in the weights ({', '.join(biases['carried'])})" if biases else ""
    return (
        f"for vLLM: LOSSY, vLLM rotates one 64-dim key shared by all {info['n_kv_heads']} key heads{carried}: check "
        f"the perplexity ratio before serving (verification.md, 'Target vllm', says what changed); {size}"
    )


def note(info: dict) -> str:
    """What the vllm target keeps and loses, in one paragraph (the report's; `short_note` the summary's)."""
    G, d = info["n_kv_heads"], info["head_dim"]
    cache, gqa = info["kv_cache_dims_per_token_per_layer"], info["gqa_cache_dims_per_token_per_layer"]
    size = "LARGER than" if cache > gqa else "smaller than"
    text = (
        f"DeepseekV3ForCausalLM for vLLM's MLA: {cache} cached values per token per layer, {size} the original GQA "
        f"cache ({gqa} = 2·{G}·{d}); the saving comes at 7B+ (Llama-3-8B: 2048 -> 576). "
    )
    if info["exact"]:
        return text + "Exact: one key/value head of head_dim 64 fits vLLM's 64 shared rotary dims."
    kept = [e for e in info["rotary_key_energy_kept"] if e is not None]
    share = f" (they carry {100 * sum(kept) / len(kept):.1f}% of the key energy)" if kept else ""
    stand_ins: dict[str | None, str] = {  # by info's position_free_terms (None: it names none)
        "fit": " and replaced by fixed 2x2 maps per head and frequency, on those terms and on the rotary query, "
        "fitted on the calibration text (least squares on key samples drawn from the attention)",
        "nope": " (the terms kept unrotated)",
    }
    stand_in = stand_ins.get(info.get("position_free_terms"), f" (stand-in: {info.get('position_free_terms')})")
    f = info.get("frequency_fold", 1)
    components = f"{G} key heads' rotary pairs" if f == 1 else f"{G} key heads' {f} folded frequency pairs"
    folded = (
        f"; head_dim {d} folds {f} source frequencies into each of vLLM's 32 (the others turn at the slot's)"
        if f > 1
        else ""
    )
    latent = ""
    if info.get("latent_compressed"):
        latent = (
            f" The latent is COMPRESSED: the position-free keys and values need {info['latent_content_dims']} dims, "
            f"vLLM holds {info['latent_dims_used']} ({info['latent_weighting']}-weighted factorization)."
        )
    return text + (
        f"LOSSY: vLLM rotates only 64 key dims shared by all heads, one frequency set{folded}; of the {components} "
        f"per rotary slot the principal mixture stays rotary{share}, the other {G * f - 1} become position-free "
        f"(NoPE) dims in the latent, their rotation dropped{stand_in}.{latent}{_bias_note(info)} Stock "
        "transformers' DeepseekV3 computes the same model as vLLM (compare there)."
    )


def _left_out(biases: dict) -> float:
    """The largest share of a bias any layer's carrier leaves out (q/k/v's and o_proj's)."""
    return max(biases["left_out_share"] + biases.get("o_proj_left_out_share", []))


def _bias_note(info: dict) -> str:
    """The note's sentence on carried attention biases ('' without)."""
    biases = info.get("attention_biases")
    if not biases:
        return ""
    worst = {proj: max(errors) for proj, errors in biases["output_error"].items()}
    figures = ", ".join(f"{proj} {100 * err:.2g}%" for proj, err in worst.items())
    return (
        f" The attention biases ({', '.join(biases['carried'])}), which vLLM's DeepSeek-V3 does not have, are carried "
        f"in the weights on the calibration inputs: at most {100 * _left_out(biases):.2g}% of a bias left "
        f"out, each projection's output off by at most {figures} (mean square)."
    )
