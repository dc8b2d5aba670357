"""RoPE in one place: what a config says of it (`config`, no torch), its frequencies and their scalings
(`frequencies`), and the rotation by them (`rotation`). Everything else that touches RoPE calls these:
the exact factorization of rotating keys (`convert.linalg.rope_factor`), the latent's rotation as one
operator (`convert.mla.latent_rope`), and each target's way of writing the source's frequencies
(`convert.targets.deepseek.rope`, `convert.targets.vllm.rope`).

Nothing is imported here, so that reading a config stays light (`convert --help` imports no torch).
"""
