"""The shapes of one converted layer's tensors in the native format, from its ranks, layout and the
source's biases alone: what a plan lays out and what `convert.mla.schema` checks a checkpoint against."""

from convert.arch import AttentionSpec
from convert.source import norm_shape


def output_shapes(spec: AttentionSpec, ranks: dict[str, int], layout: str, biases: set[str]) -> dict[str, tuple]:
    """Shapes of the tensors `convert_layer` returns, from ranks and source biases alone.

    biases: which source biases exist, among "q", "k", "v", "o".
    """
    hidden, inner, n_heads = spec.hidden_size, spec.n_heads * spec.head_dim, spec.n_heads
    joint = "rank_kv" in ranks
    rank_k = ranks["rank_kv"] if joint else ranks["rank_k"]
    rank_v = ranks["rank_kv"] if joint else ranks["rank_v"]
    shapes: dict[str, tuple[int, ...]] = {}
    keys = spec.n_kv_heads * spec.head_dim
    if joint:
        shapes["kv_down.weight"] = (rank_k, hidden)
    else:
        compressed_norm = spec.qk_norm is not None and rank_k < keys  # q/k norm: every key, normed, then cut
        k_rows = keys if compressed_norm else rank_k
        shapes["k_down.weight"] = (k_rows, hidden)
        if spec.rope and "k" in biases:
            shapes["k_down.bias"] = (k_rows,)
        if compressed_norm:
            shapes["k_compress.weight"] = (rank_k, keys)
        shapes["v_down.weight"] = (rank_v, hidden)
    q_name, o_name = ("q_absorbed", "o_absorbed") if layout == "absorbed" else ("q_proj", "o_proj")
    q_rows = n_heads * rank_k if layout == "absorbed" else inner
    if spec.qk_norm is not None:  # the query is normalised live: W^Q, then W^UK at run time
        q_name, q_rows = "q_proj", inner
        q_norm, k_norm = norm_shape(spec, "q"), norm_shape(spec, "k")
        shapes |= {"q_norm.weight": q_norm, "k_norm.weight": k_norm, "k_up.weight": (inner, rank_k)}
    o_cols = n_heads * rank_v if layout == "absorbed" else inner
    shapes[f"{q_name}.weight"] = (q_rows, hidden)
    if "q" in biases:
        shapes[f"{q_name}.bias"] = (q_rows,)
    if layout == "factored":
        shapes |= {"k_up.weight": (inner, rank_k), "v_up.weight": (inner, rank_v)}
    shapes[f"{o_name}.weight"] = (hidden, o_cols)
    if biases & {"o", "v"}:
        shapes[f"{o_name}.bias"] = (hidden,)
    return shapes
